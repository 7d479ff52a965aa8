"""x"""
def action(s, paths): pass

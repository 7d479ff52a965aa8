"""x"""
def report(s): pass

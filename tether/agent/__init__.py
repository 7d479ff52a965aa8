"""`tether agent`: on a machine tether cannot reach, run what a mailbox's signed requests ask for."""

"""jmp_lab's private implementation; the modules users import are faces over it."""

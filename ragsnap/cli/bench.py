def register(subparsers): pass

import sys
import mlxcel_core
from mlxcel_core.backends import base
if sys.argv[1] == "on":
    base.Backend.compile_by_default = lambda self: True
from mlxcel_cli.main import main
sys.exit(main(["bench", "-p", "0", "-n", "32", "-r", "3"] + sys.argv[2:]))

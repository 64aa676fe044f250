import sys
import mlxcel_core.loading.weights as w
w.float32_on_cpu = lambda model: False  # the behaviour before: half-precision scales stay
from mlxcel_cli.main import main
sys.exit(main(sys.argv[1:]))

# run mlxcel bench with the half-precision swap switched off (the quantized one kept)
import sys
from mlxcel_core.backends import cpu_float32
cpu_float32.HALF = ()
from mlxcel_cli.main import app
sys.argv = ["mlxcel", *sys.argv[1:]]
app()

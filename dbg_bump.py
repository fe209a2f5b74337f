import warnings, torch
warnings.simplefilter("error")
import metrale_graph.ops as ops
from metrale_graph.ops import REGISTRY, example_args, Shapes
s = Shapes(lengths=(3, 5), context=(0, 0))
args = example_args("gdn_recurrence", s, torch.float32, seed=0)
v0 = args[7]._version
o = torch.ops.metrale.gdn_recurrence(*args)
print("version", v0, args[7]._version)
pool = torch.zeros(3, *args[7].shape[1:])
v1 = pool._version
o = torch.ops.metrale.gdn_recurrence(*args, torch.tensor([2, -1]), torch.tensor([0, 2]), pool)
print("pool version", v1, pool._version, pool[0].abs().sum() > 0)
a = example_args("causal_conv1d", s, torch.float32, seed=0)
torch.ops.metrale.causal_conv1d(*a)
torch.library.opcheck(torch.ops.metrale.gdn_recurrence.default, args)
print("ok")

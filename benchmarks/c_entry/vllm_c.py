"""C entry vs Python entry in a real vLLM engine: graft's attention and fused ops in the path."""
import sys
from graft.tools.bench import vllm as B
from graft.tools.cli import main

serve = {"GRAFT_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN", "GRAFT_BACKENDS": "torch"}
B.VARIANTS["c_entry"] = dict(serve, GRAFT_DISPATCH_C="1")
B.VARIANTS["python_entry"] = dict(serve, GRAFT_DISPATCH_C="0")
sys.exit(main(["bench", "vllm", "--variants", "c_entry,python_entry", "--workloads", "decode,prefill",
               "--rounds", sys.argv[1], "--json", sys.argv[2] if len(sys.argv) > 2 else "vllm_c.json", "--profile"]))

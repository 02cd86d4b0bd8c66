import sys
from graft.tools.bench import vllm as B
from graft.tools.cli import main
before, after = "/tmp/wt", "/work/main"
forced = {"GRAFT_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN", "GRAFT_BACKENDS": "torch"}
B.VARIANTS["before_default"] = {"PYTHONPATH": before}
B.VARIANTS["after_default"] = {"PYTHONPATH": after}
B.VARIANTS["before_forced"] = dict(forced, PYTHONPATH=before)
B.VARIANTS["after_forced"] = dict(forced, PYTHONPATH=after)
sys.exit(main(["bench", "vllm", "--variants", "before_default,after_default,before_forced,after_forced",
               "--workloads", "decode,prefill", "--rounds", sys.argv[1], "--json", "/tmp/cmeasure/vllm_before_after.json"]))

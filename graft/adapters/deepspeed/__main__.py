"""Run a DeepSpeed training script with graft active, without editing it.

    deepspeed --num_gpus 2 --module graft.adapters.deepspeed train.py --deepspeed_config ds.json
    python -m graft.adapters.deepspeed train.py ...
    python -m graft.adapters.deepspeed            # no script: activate and show what is routed

The DeepSpeed launcher puts ``--local_rank=N`` before the script path; it is handed on to
the script, which expects it there.
"""
import runpy
import sys

from graft.adapters.deepspeed import activate


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_args = []
    while argv and argv[0].startswith("--local_rank"):
        launcher_args.append(argv.pop(0))
    if not argv or argv[0] == "--status":
        from graft.adapters.deepspeed.integration import status_lines

        print("\n".join(status_lines()))
        return
    script = argv.pop(0)
    activate()
    sys.argv = [script] + launcher_args + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

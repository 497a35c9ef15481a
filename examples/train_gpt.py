"""Train a small GPT (byte level) across pipeline ranks with pipesched, then show where the bubble was.

The script form of ``pipesched demo``, whose code is in the package (``pipesched/demo/``: the model, the data
— the Python standard library's own source, or ``--data`` — and the training loop), so the demo also runs
from an installed package. Run (4 pipeline ranks on this machine's CPUs, gloo):

    torchrun --nproc-per-node 4 examples/train_gpt.py --schedule 1f1b --steps 200
    python examples/train_gpt.py       # the same, spawning the ranks itself (= pipesched demo)

World size = ranks x dp; see ``--help`` for the options.
"""
from pipesched.demo.train import main

if __name__ == "__main__":
    main()

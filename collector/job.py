"""``python -m collector.job [stepmem run options]``: the main job as an entry point, for
``ray job submit --working-dir . -- python -m collector.job ...`` (the same as ``stepmem run``).
The job itself is :mod:`collector.run.job`."""

if __name__ == "__main__":
    import sys

    from collector.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))

"""Start the IPython kernel of one sandbox with the toolbox preloaded and the output cap on.

    python -m l0_toolbox.boot -f CONNECTION_FILE [ipykernel options]

ipykernel's own launcher with the output cap and the tools installed between initialize and start; a toolbox that
fails to import stops the kernel (the host sees the traceback).
"""

import os
import sys


def main(argv=None) -> None:
    sys.modules["debugpy"] = None  # no debugger (its import: ~0.1 s of a start's ~0.45 s CPU); None: ImportError
    from ipykernel.kernelapp import IPKernelApp

    import l0_toolbox
    from l0_toolbox._capture import OutputCap

    app = IPKernelApp.instance()
    app.initialize(sys.argv[1:] if argv is None else argv)
    OutputCap(int(os.environ.get("L0_MAX_OUTPUT_CHARS", "8000"))).install(app.session)
    app.shell.push({name: getattr(l0_toolbox, name) for name in l0_toolbox.__all__}, interactive=False)
    app.start()


if __name__ == "__main__":
    main()

"""The hook torch runs at ``import torch``, so that ``init_process_group(backend="smddp")`` works
in a script that never imports smddp_lite (as scripts written for SageMaker's library expect).

torch loads every entry point of the group "torch.backends" at the end of its own import
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). Loading this module imports the package,
which registers the backend; when the package is itself mid-import (the script imported
smddp_lite before torch), a stand-in that imports it on first use is registered instead, and the
package replaces it as its import finishes. An exception here would make torch itself fail to
import, so a failure becomes a warning that names this package.
"""

from __future__ import annotations

import warnings

# defined here, where nothing of the package is imported, and re-exported by _registration
BACKEND_NAME = "smddp"


def register() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, create_on_first_use, extended_api=True,
                                          devices=["cpu", "cuda"])
    except Exception as exc:  # noqa: BLE001 (torch would turn it into a failed import of torch)
        warnings.warn(f"smddp-lite: the 'smddp' torch.distributed backend could not be registered when torch was "
                      f"imported ({type(exc).__name__}: {exc}); `import smddp_lite` in the script shows the "
                      "full error", stacklevel=2)


def create_on_first_use(*args, **kwargs):
    from smddp_lite.backend.process_group import create_process_group

    return create_process_group(*args, **kwargs)

"""`import overcast.distributed` registers the torch.distributed backend "overcast":

    import overcast.distributed
    dist.init_process_group("overcast")

Every collective of the group runs on an overcast Communicator made for it (docs/backend.md).
"""

from overcast.distributed.backend import ALGORITHM_ENV, BACKEND_NAME, ProcessGroupOvercast, register

register()

__all__ = ["ProcessGroupOvercast", "ALGORITHM_ENV", "BACKEND_NAME", "register"]

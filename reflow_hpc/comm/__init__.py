"""The bottom communication layer: MPI start-up and polling (``mpi``: the one polling helper
``wait_until``, deadlines that name the rank and the operation), the typed control channel
(``channel``), the torch.distributed bootstrap (``dist``), bounded collectives (``collective``) and
ending the job when a rank fails (``failure``). Storage, rollout, train and runtime import it; it
imports none of them. Import the modules themselves: this package imports nothing.
"""

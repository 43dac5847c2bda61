"""Starting a job's ranks from the command line: ``trainguard run`` with torchrun's flags, with a
node agent, without one, or across nodes through a rendezvous."""

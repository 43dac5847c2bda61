"""A job's life on this node: its spec and states (jobs), starting its ranks cold or from the warm
launcher (launcher, zygote_client), watching and restarting them (supervisor), the records that
let a restarted agent adopt them (records), the plan the ranks read (plans), and streaming a job's
output to the command line (follow)."""

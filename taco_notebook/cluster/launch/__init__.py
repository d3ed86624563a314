"""Where and how a cluster's engines are launched: profiles (local, hosts, slurm, mpijob), the MPI found, host lists
and size limits.
"""

"""Trainer ranks in processes of their own, on one node or many: the layout check, the torchrun
launch (which node runs what) and the driver's control channel to the ranks."""
from clawrl.cluster.control import ClusterError, ControlServer
from clawrl.cluster.launch import NodeEnv, read_node_env, run_worker_node, start_trainer_ranks
from clawrl.cluster.layout import check_layout, describe_layout

__all__ = ["ClusterError", "ControlServer", "NodeEnv", "check_layout", "describe_layout", "read_node_env",
           "run_worker_node", "start_trainer_ranks"]

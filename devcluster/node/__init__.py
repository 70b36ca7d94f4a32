"""A real node beside the kwok fleet: containerd and runc, the CNI bridge, the kubelet, kube-proxy and CoreDNS,
run as children of the local cluster, so the operator's own pods start real containers.

`config` renders every component's configuration (pure), `host` snapshots and restores what the node changes
on the host, `node` starts and stops the components in order.
"""

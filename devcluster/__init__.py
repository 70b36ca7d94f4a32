"""The local control plane: Go-built kube-apiserver, etcd, controller-manager, scheduler and kwok,
with simulated P5en and Trainium nodes."""

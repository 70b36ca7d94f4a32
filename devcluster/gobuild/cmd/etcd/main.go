// Command etcd is the etcd 3.6 server, built from the same module graph as
// kube-apiserver (k8s.io/kubernetes already requires go.etcd.io/etcd/server/v3),
// because the etcd root module's local replace lines block `go install`.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

// Command k8sbin builds kube-apiserver and etcd for the Kubernetes tests into
// the per-user cache, or finds them there, and prints their paths:
//
//	go run ./internal/k8stest/k8sbin [-node]
//
// `make test-k8s` runs it before the tests so that a cold build (~8 min)
// shows its progress instead of hiding it inside a quiet `go test`. With
// -node it also builds what a node adds (kube-controller-manager,
// kube-scheduler, kubelet, kube-proxy, kubectl: make test-node).
//
// When the build fails it exits 1 if RLAGENT_REQUIRE_ROOT_TESTS=1, and
// otherwise exits 0 after saying so: the tests then skip with the same reason,
// as they would without it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	node := flag.Bool("node", false, "also build the node's binaries")
	flag.Parse()
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
	apiserver, etcd, err := k8stest.EnsureBinaries(ctx, logf)
	var nodeBins map[string]string
	if err == nil && *node {
		nodeBins, err = k8stest.EnsureNodeBinaries(ctx, logf)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "k8sbin: %v\n", err)
		if os.Getenv(testenv.RequireRootEnv) == "1" {
			os.Exit(1)
		}
		fmt.Fprintf(os.Stderr, "k8sbin: the Kubernetes tests will skip (%s=1 makes that a failure)\n", testenv.RequireRootEnv)
		return
	}
	fmt.Println(apiserver)
	fmt.Println(etcd)
	for _, p := range nodeBins {
		fmt.Println(p)
	}
}

// Command helm renders and installs the rlagent chart (deploy/helm/rlagent)
// with the Helm Go SDK, without a helm binary:
//
//	go -C hack/helm run . render --repo ../..
//	    renders the chart with its default values (release rlagent in
//	    rlagent-system, namespace.create true) into deploy/*.yaml, one file
//	    per template, and copies deploy/crd.yaml (controller-gen's) into the
//	    chart's crds/. `make generate` runs it; verify-generate checks it.
//	go -C hack/helm run . install --kubeconfig FILE --chart DIR [--set k=v] [-f values.yaml]
//	    installs the chart, or upgrades the release when it exists (helm
//	    upgrade --install), and waits until the DaemonSet's pods are ready.
//
// It is a module of its own (hack/helm/go.mod) because Helm v4 needs
// k8s.io v0.36 while rlagent is on v0.34; the main module never imports it.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	switch os.Args[1] {
	case "render":
		err = renderCmd(os.Args[2:])
	case "install":
		err = installCmd(ctx, os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "helm "+os.Args[1]+":", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, `usage: helm render [--repo DIR]
       helm install --kubeconfig FILE [--chart DIR] [--namespace NS] [--release NAME] [--create-namespace] [--set K=V]... [-f FILE]... [--timeout D]`)
	os.Exit(2)
}

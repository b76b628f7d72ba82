package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/chart/loader"
	"helm.sh/helm/v4/pkg/cli"
	"helm.sh/helm/v4/pkg/cli/values"
	"helm.sh/helm/v4/pkg/getter"
	"helm.sh/helm/v4/pkg/kube"
	releasev1 "helm.sh/helm/v4/pkg/release/v1"
	"helm.sh/helm/v4/pkg/storage/driver"
	"k8s.io/cli-runtime/pkg/genericclioptions"
)

// repeated is a flag that may be given more than once.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ",") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

func installCmd(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("install", flag.ExitOnError)
	var (
		kubeconfig = fs.String("kubeconfig", os.Getenv("KUBECONFIG"), "the cluster's kubeconfig (default $KUBECONFIG)")
		chart      = fs.String("chart", "../../"+chartDir, "the chart's directory")
		namespace  = fs.String("namespace", releaseNamespace, "the release namespace, where the agents run")
		release    = fs.String("release", releaseName, "the release's name")
		createNS   = fs.Bool("create-namespace", false, "create the release namespace if it is missing (helm install --create-namespace)")
		timeout    = fs.Duration("timeout", 5*time.Minute, "how long to wait for the DaemonSet's pods to be ready")
		opts       values.Options
	)
	fs.Var((*repeated)(&opts.Values), "set", "a value, KEY=VALUE (helm --set); repeatable")
	fs.Var((*repeated)(&opts.StringValues), "set-string", "a string value, KEY=VALUE (helm --set-string); repeatable")
	fs.Var((*repeated)(&opts.JSONValues), "set-json", "a JSON value, KEY=JSON (helm --set-json); repeatable")
	fs.Var((*repeated)(&opts.ValueFiles), "f", "a values file (helm -f); repeatable")
	fs.Parse(args)
	if fs.NArg() != 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *kubeconfig == "" {
		return errors.New("--kubeconfig: required (or $KUBECONFIG)")
	}
	vals, err := opts.MergeValues(getter.All(cli.New()))
	if err != nil {
		return err
	}
	rel, err := install(ctx, installOptions{
		Kubeconfig: *kubeconfig, Chart: *chart, Namespace: *namespace, Release: *release,
		CreateNamespace: *createNS, Timeout: *timeout, Values: vals,
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	if err != nil {
		return err
	}
	fmt.Printf("release %s in %s: revision %d, %s\n%s", rel.Name, rel.Namespace, rel.Version, rel.Info.Status, rel.Info.Notes)
	return nil
}

type installOptions struct {
	Kubeconfig, Chart, Namespace, Release string
	CreateNamespace                       bool
	Timeout                               time.Duration
	Values                                map[string]any
	Log                                   *slog.Logger
}

// install installs the chart as o.Release, or upgrades the release when
// it exists (helm upgrade --install), with server-side apply, and waits
// until every object it applied is ready by kstatus: for the DaemonSet,
// every node's pod of the new revision updated and available.
func install(ctx context.Context, o installOptions) (*releasev1.Release, error) {
	ch, err := loader.Load(o.Chart)
	if err != nil {
		return nil, fmt.Errorf("load chart %s: %w", o.Chart, err)
	}
	getter := genericclioptions.NewConfigFlags(false)
	getter.KubeConfig = &o.Kubeconfig
	getter.Namespace = &o.Namespace
	cfg := action.NewConfiguration(action.ConfigurationSetLogger(o.Log.Handler()))
	if err := cfg.Init(getter, o.Namespace, "secret"); err != nil {
		return nil, fmt.Errorf("helm configuration: %w", err)
	}

	hist := action.NewHistory(cfg)
	hist.Max = 1
	_, err = hist.Run(o.Release)
	switch {
	case errors.Is(err, driver.ErrReleaseNotFound):
		in := action.NewInstall(cfg)
		in.ReleaseName, in.Namespace, in.CreateNamespace = o.Release, o.Namespace, o.CreateNamespace
		in.ServerSideApply = true
		in.WaitStrategy, in.Timeout = kube.StatusWatcherStrategy, o.Timeout
		o.Log.Info("installing", "release", o.Release, "namespace", o.Namespace, "chart", o.Chart)
		r, err := in.RunWithContext(ctx, ch, o.Values)
		return asRelease(r, err, "install")
	case err != nil:
		return nil, fmt.Errorf("release history of %s: %w", o.Release, err)
	}
	up := action.NewUpgrade(cfg)
	up.Namespace = o.Namespace
	up.ServerSideApply = "true"
	up.WaitStrategy, up.Timeout = kube.StatusWatcherStrategy, o.Timeout
	o.Log.Info("upgrading", "release", o.Release, "namespace", o.Namespace, "chart", o.Chart)
	r, err := up.RunWithContext(ctx, o.Release, ch, o.Values)
	return asRelease(r, err, "upgrade")
}

func asRelease(r any, err error, what string) (*releasev1.Release, error) {
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	rel, ok := r.(*releasev1.Release)
	if !ok {
		return nil, fmt.Errorf("%s: a release of type %T", what, r)
	}
	return rel, nil
}

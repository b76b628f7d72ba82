package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/client/clientset/versioned"
	"github.com/rlagent/rlagent/watcher"
)

// kubeFlags select the cluster: --kubeconfig, or the in-cluster config when
// running in a pod.
type kubeFlags struct {
	kubeconfig string
}

func (k *kubeFlags) register(cmd *cobra.Command) {
	cmd.PersistentFlags().StringVar(&k.kubeconfig, "kubeconfig", "", "talk to this cluster (default: the in-cluster config when running in a pod, else none)")
}

// config returns the cluster's REST config, or nil outside a cluster.
func (k *kubeFlags) config() (*rest.Config, error) {
	if k.kubeconfig != "" {
		c, err := clientcmd.BuildConfigFromFlags("", k.kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig: %w", err)
		}
		return c, nil
	}
	if os.Getenv("KUBERNETES_SERVICE_HOST") == "" {
		return nil, nil
	}
	c, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("in-cluster config: %w", err)
	}
	return c, nil
}

// clusterFlags are run's flags for the Kubernetes source.
type clusterFlags struct {
	kubeFlags
	node      string
	ns        string
	daemonSet string
	pod       string
}

func (c *clusterFlags) register(cmd *cobra.Command) {
	c.kubeFlags.register(cmd)
	cmd.Flags().StringVar(&c.node, "node-name", os.Getenv("NODE_NAME"), "this node's name, for the scopes service and pods (default $NODE_NAME)")
	cmd.Flags().StringVar(&c.ns, "agent-namespace", os.Getenv("POD_NAMESPACE"),
		"namespace of the agents' DaemonSet (the nodes scope's count) and of the Lease that elects the status writer (default $POD_NAMESPACE)")
	cmd.Flags().StringVar(&c.daemonSet, "agent-daemonset", "rlagent", "the agents' DaemonSet: the nodes scope divides by its ready pods (status.numberReady)")
	cmd.Flags().StringVar(&c.pod, "pod-name", os.Getenv("POD_NAME"), "this agent's name in the status writer's election (default $POD_NAME, else the host name)")
}

// source returns the Kubernetes source, or nil outside a cluster.
func (c *clusterFlags) source(log *slog.Logger) (*watcher.Kubernetes, error) {
	cfg, err := c.config()
	if err != nil || cfg == nil {
		return nil, err
	}
	if c.node == "" {
		return nil, errors.New("--node-name: required in a cluster (set NODE_NAME from the downward API)")
	}
	if c.ns == "" {
		return nil, errors.New("--agent-namespace: required in a cluster (set POD_NAMESPACE from the downward API)")
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	rls, err := versioned.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return watcher.NewKubernetes(watcher.KubernetesConfig{
		Client: cs, RateLimits: rls, NodeName: c.node,
		AgentNamespace: c.ns, AgentDaemonSet: c.daemonSet, Log: log,
	}), nil
}

// apiServer follows where the agent's API server connection really goes,
// so that the agent can protect it (protectAPIServer); nil outside a
// cluster. In a pod the in-cluster config's host is the ClusterIP of the
// Service default/kubernetes, which kube-proxy translates before the packets
// leave the node, so it follows that Service's endpoints; with --kubeconfig
// the packets carry the kubeconfig's host.
func (c *clusterFlags) apiServer(log *slog.Logger) (*watcher.APIServer, error) {
	cfg, err := c.config()
	if err != nil || cfg == nil {
		return nil, err
	}
	ac := watcher.APIServerConfig{Host: cfg.Host, Log: log}
	if c.kubeconfig == "" {
		if ac.Client, err = kubernetes.NewForConfig(cfg); err != nil {
			return nil, err
		}
	}
	return watcher.NewAPIServer(ac)
}

// Cluster side of `rlagent limits`: RateLimit objects.

func rateLimits(cfg *rest.Config) (dynamic.NamespaceableResourceInterface, error) {
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return dyn.Resource(watcher.RateLimitResource), nil
}

// kubeSet creates or replaces a RateLimit and returns it as stored. With
// dryRun the API server validates and defaults it and stores nothing
// (server-side dry run).
func kubeSet(ctx context.Context, cfg *rest.Config, name string, spec *v1alpha1.RateLimitSpec, dryRun bool) (*unstructured.Unstructured, error) {
	rl, err := rateLimits(cfg)
	if err != nil {
		return nil, err
	}
	raw, err := runtime.DefaultUnstructuredConverter.ToUnstructured(spec)
	if err != nil {
		return nil, err
	}
	var dry []string
	if dryRun {
		dry = []string{metav1.DryRunAll}
	}
	cur, err := rl.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		obj := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "rlagent.io/v1alpha1",
			"kind":       "RateLimit",
			"metadata":   map[string]any{"name": name},
			"spec":       raw,
		}}
		return rl.Create(ctx, obj, metav1.CreateOptions{DryRun: dry})
	}
	if err != nil {
		return nil, err
	}
	cur.Object["spec"] = raw
	return rl.Update(ctx, cur, metav1.UpdateOptions{DryRun: dry})
}

func kubeGet(ctx context.Context, cfg *rest.Config, name string, w io.Writer) error {
	rl, err := rateLimits(cfg)
	if err != nil {
		return err
	}
	obj, err := rl.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	unstructured.RemoveNestedField(obj.Object, "metadata", "managedFields")
	out, err := yaml.Marshal(obj.Object)
	if err != nil {
		return err
	}
	_, err = w.Write(out)
	return err
}

func kubeList(ctx context.Context, cfg *rest.Config, w io.Writer) error {
	rl, err := rateLimits(cfg)
	if err != nil {
		return err
	}
	list, err := rl.List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tRATE\tBURST\tUNIT\tKEY\tSCOPE\tACTION\tREPLICAS\tMATCH")
	for _, obj := range list.Items {
		var spec v1alpha1.RateLimitSpec
		raw, _, _ := unstructured.NestedMap(obj.Object, "spec")
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(raw, &spec); err != nil {
			fmt.Fprintf(tw, "%s\t(unreadable spec: %v)\n", obj.GetName(), err)
			continue
		}
		spec.Default()
		replicas, _, _ := unstructured.NestedInt64(obj.Object, "status", "replicas")
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%d\t%s\n", obj.GetName(), spec.Rate, spec.EffectiveBurst(),
			spec.Unit, spec.Key, spec.Scope, spec.Action, replicas, matchString(&spec.Match))
	}
	return tw.Flush()
}

// kubeDelete deletes a RateLimit; with dryRun the API server checks the
// deletion (the object exists, the caller may delete it) and deletes nothing.
func kubeDelete(ctx context.Context, cfg *rest.Config, name string, dryRun bool) error {
	rl, err := rateLimits(cfg)
	if err != nil {
		return err
	}
	var opts metav1.DeleteOptions
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	return rl.Delete(ctx, name, opts)
}

// Package kube is the limiter library's source of limits in a cluster:
// the RateLimits with unit requests and scope service that name the
// process's own Service, each divided by that Service's ready endpoints.
// It is the node agent's Kubernetes watcher, narrowed to what an
// application may read (deploy/limiter/rbac.yaml). A package of its own so
// that a program without Kubernetes imports no client-go.
package kube

import (
	"fmt"
	"log/slog"
	"os"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/rlagent/rlagent/client/clientset/versioned"
	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/limiter/spec"
	"github.com/rlagent/rlagent/watcher"
)

// Options configure NewSource. The zero value of each field
// is documented; Service is required.
type Options struct {
	// Config is how to reach the API server. nil: the pod's own
	// (rest.InClusterConfig).
	Config *rest.Config
	// Namespace is the process's namespace, where its Service is. "":
	// the environment's POD_NAMESPACE (the downward API's
	// metadata.namespace).
	Namespace string
	// Service is the name of the process's own Service (in Namespace):
	// the limits of scope service that name it (match.service
	// Namespace/Service) are this process's, each divided by the
	// Service's ready endpoints.
	Service string
	// Log is where the source logs (nil: slog.Default()).
	Log *slog.Logger
}

// NewSource is a Source of the cluster's RateLimits with unit
// requests, scope service and match.service this process's Service, each
// divided by that Service's ready endpoints: the process's replicas. It
// is the node agent's Kubernetes watcher (watcher.Kubernetes), narrowed
// to what an application may read: the RateLimits (a ClusterRole: get,
// list, watch) and the EndpointSlices of its own namespace (a Role: list,
// watch); it watches no DaemonSet and writes nothing. While the API server
// cannot be reached, the last count stands and its age grows
// (rlagent_limiter_count_age_seconds). Nothing is applied before the
// watches have synced once, so that a starting process never takes a
// whole global rate for lack of a count.
func NewSource(o Options) (limiter.Source, error) {
	if o.Namespace == "" {
		o.Namespace = os.Getenv("POD_NAMESPACE")
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	switch {
	case o.Namespace == "":
		return nil, fmt.Errorf("kube: Options.Namespace is empty and POD_NAMESPACE is not set: set it from the downward API (fieldRef metadata.namespace)")
	case len(validation.IsDNS1123Label(o.Namespace)) > 0:
		return nil, fmt.Errorf("kube: Options.Namespace %q is not a namespace's name", o.Namespace)
	case o.Service == "":
		return nil, fmt.Errorf("kube: Options.Service is required: the name of the process's own Service, whose ready endpoints divide its limits")
	case len(validation.IsDNS1035Label(o.Service)) > 0:
		return nil, fmt.Errorf("kube: Options.Service %q is not a Service's name", o.Service)
	}
	cfg := o.Config
	if cfg == nil {
		var err error
		if cfg, err = rest.InClusterConfig(); err != nil {
			return nil, fmt.Errorf("kube: the pod's API server config: %w", err)
		}
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kube: %w", err)
	}
	rls, err := versioned.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kube: %w", err)
	}
	k := watcher.NewKubernetes(watcher.KubernetesConfig{
		Client:         client,
		RateLimits:     rls,
		SliceNamespace: o.Namespace,
		WithoutAgents:  true,
		Log:            o.Log,
	})
	return &spec.Source{
		Limits:  k.Limits,
		Count:   k,
		Service: o.Namespace + "/" + o.Service,
		Synced:  k.Synced,
		Log:     o.Log.With("service", o.Namespace+"/"+o.Service),
	}, nil
}

package cluster

import (
	"context"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/rlagent/rlagent/client/clientset/versioned"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/watcher"
)

// These tests run against one real API server (k8stest.Shared), each in a
// namespace of its own; RateLimits are cluster-scoped, so each test names
// its own.

func TestMain(m *testing.M) { os.Exit(k8stest.RunShared(m)) }

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func sharedEnv(t *testing.T) *k8stest.Env {
	t.Helper()
	env := k8stest.Shared(t)
	env.InstallCRD(t, "../deploy/crd.yaml")
	return env
}

// source is one agent's Kubernetes source, as the agent runs it: what the
// status writer, the reporter and the demand publisher read.
type source struct {
	k      *watcher.Kubernetes
	cancel context.CancelFunc
	done   chan struct{}
}

func startSource(t *testing.T, env *k8stest.Env, ns, node string) *source {
	t.Helper()
	s := &source{done: make(chan struct{})}
	s.k = watcher.NewKubernetes(watcher.KubernetesConfig{
		Client:     kubernetes.NewForConfigOrDie(env.Config),
		RateLimits: versioned.NewForConfigOrDie(env.Config),
		NodeName:   node, AgentNamespace: ns,
		ProbeInterval: 200 * time.Millisecond, Log: quietLog(),
	})
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	go func() { s.k.Run(ctx, func() {}); close(s.done) }()
	t.Cleanup(s.stop)
	k8stest.WaitUntil(t, node+"'s caches to sync", s.k.Synced)
	return s
}

func (s *source) stop() {
	s.cancel()
	<-s.done
}

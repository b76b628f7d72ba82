package main

import (
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/rlagent/rlagent/agent"
)

func newRunCmd() *cobra.Command {
	var (
		config    string
		logLevel  string
		logFormat string
		pinDir    string
		ephemeral bool
		hostIPs   string
		cluster   clusterFlags
	)
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run the node agent: attach the data path and keep the shares current",
		Long: `run loads the data path, attaches it to the configured interfaces (or, with interfaces:
auto, those of the node's default routes and of --host-ips, followed as routes change) in
XDP (native mode, falling back to generic; TC ingress with xdpFallback tc), to their TC egress for egress
limits and to each local endpoint's interface (TC) for limits with attach endpoints, pins
its maps and links under the pin directory, and keeps each limit's node share current as
the replica count and the config file change.

In a cluster (--kubeconfig, or in a pod), the limits are the RateLimit objects, the nodes
scope divides by the ready agents (status.numberReady of the DaemonSet --agent-daemonset in
--agent-namespace) and the service scope by the ready endpoints of the Service, weighted by
those on this node (--node-name). The config file then holds no limits. One agent, elected
with the Lease rlagent-status in --agent-namespace, writes the RateLimits' status; every
agent reports what it could not apply in its own Lease (rlagent-demand-NODE), which the
writer reflects in each RateLimit's Accepted condition.

On SIGTERM, SIGINT or SIGKILL the agent exits and the pinned data path keeps enforcing
the last shares. The next "rlagent run" adopts the pins without detaching. "rlagent
cleanup" detaches and removes them.

One agent per pin directory: the agent locks it for its life, and a second one exits
naming the holder (PID, host, pod). The pin directory must be on a BPF filesystem that
outlives the agent: the host's (/sys/fs/bpf; in Kubernetes the hostPath
/sys/fs/bpf/rlagent). A bpffs the agent would mount itself in a mount namespace of its
own (under "ip netns exec", "unshare -m" or in a container) dies with it, and the
limits with it: the agent refuses to start unless --ephemeral-pins says that is meant.
Under "ip netns exec", point --pin-dir at a bpffs mounted outside /sys, or enter only
the network namespace ("nsenter --net=/run/netns/NAME rlagent run ...").

Health: /readyz (and /healthz) answer 503 with the reasons while an interface is not
attached or the last reconcile failed; /livez answers 503 if the agent's loop stalls.
A stale count is reported there as a note but keeps the agent ready.`,
		Example: `  rlagent run --config /etc/rlagent/rlagent.yaml
  rlagent run --config rlagent.yaml --log-level debug --log-format json
  # a demo in a network namespace, accepting that the limits end with the agent
  ip netns exec demo rlagent run --config rlagent.yaml --ephemeral-pins
  # in a cluster (deploy/daemonset.yaml sets these from the downward API)
  NODE_NAME=node-1 POD_NAMESPACE=rlagent-system HOST_IPS=10.0.0.5 rlagent run --config /etc/rlagent/rlagent.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := newLogger(logLevel, logFormat)
			if err != nil {
				return err
			}
			ips, err := parseHostIPs(hostIPs)
			if err != nil {
				return err
			}
			k8s, err := cluster.source(log.With("source", "kubernetes"))
			if err != nil {
				return err
			}
			api, err := cluster.apiServer(log.With("source", "apiserver"))
			if err != nil {
				return err
			}
			kube, err := cluster.config() // secureMetrics' reviews
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return agent.Run(ctx, agent.Options{ConfigPath: config, Log: log, Kubernetes: k8s, APIServer: api, KubeConfig: kube, Identity: cluster.pod,
				PinDir: pinDir, EphemeralPins: ephemeral, HostIPs: ips, Ready: func(addr string) {
					log.Info("ready", "metrics", addr)
				}})
		},
	}
	cmd.Flags().StringVarP(&config, "config", "c", defaultConfig, "config file (YAML, see docs/config.md)")
	cmd.Flags().StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn, error")
	cmd.Flags().StringVar(&logFormat, "log-format", "text", "log format: text, json")
	cmd.Flags().StringVar(&pinDir, "pin-dir", "", "pin directory, on a bpffs (default: the config's pinDir)")
	cmd.Flags().BoolVar(&ephemeral, "ephemeral-pins", false,
		"accept a pin directory that does not outlive the agent (a bpffs of its own in a private mount namespace): enforcement then stops when the agent does")
	cmd.Flags().StringVar(&hostIPs, "host-ips", os.Getenv("HOST_IPS"),
		"the node's own addresses, comma-separated (default $HOST_IPS; in a pod, the downward API's status.hostIPs): with interfaces: auto, the interfaces that hold them are uplinks")
	cluster.register(cmd)
	return cmd
}

// parseHostIPs reads --host-ips: addresses separated by commas (the
// downward API's status.hostIPs) or spaces; "" is none.
func parseHostIPs(s string) ([]netip.Addr, error) {
	var out []netip.Addr
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		ip, err := netip.ParseAddr(f)
		if err != nil {
			return nil, fmt.Errorf("--host-ips: %q is not an IP address (want addresses separated by commas, e.g. 10.0.0.5,fd00::5)", f)
		}
		out = append(out, ip.Unmap())
	}
	return out, nil
}

func newLogger(level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level: %q is not one of debug, info, warn, error", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch strings.ToLower(format) {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format: %q is not one of text, json", format)
}

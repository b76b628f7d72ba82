// Command rlagent is the rlagent node agent and its command-line tools.
//
// rlagent enforces global rate limits at the node's share, in XDP and TC:
// Watch (the replica count) -> Divide (the global limit by it) -> Enforce
// (per-key token buckets in per-CPU BPF maps).
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// version is set at link time: -ldflags "-X main.version=v1.2.3".
var version = "dev"

const defaultConfig = "/etc/rlagent/rlagent.yaml"

func main() {
	if err := newRoot().Execute(); err != nil {
		var ec exitCode
		if errors.As(err, &ec) {
			os.Exit(int(ec))
		}
		fmt.Fprintln(os.Stderr, "rlagent:", err)
		os.Exit(1)
	}
}

// exitCode ends the program with a code and no message.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit %d", int(e)) }

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "rlagent",
		Short: "Global rate limits enforced in XDP and TC at each node's share",
		Long: `rlagent enforces global rate limits without a shared counter on the packet path.
It watches the replica count behind each limit, divides the global rate by it, and
enforces the node's share with per-key token buckets in per-CPU BPF maps: in XDP on
the uplinks' ingress, in TC on their egress and at each local endpoint's interface.
When the count changes, it rewrites the refill rates while packets keep flowing.`,
		Example: `  rlagent run --config /etc/rlagent/rlagent.yaml
  rlagent validate --config rlagent.yaml
  rlagent limits set dns --rate 20000 --protocol udp --dst-ports 53 --dry-run
  rlagent status --watch`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newRunCmd(), newValidateCmd(), newLimitsCmd(), newStatusCmd(), newCleanupCmd(), newVersionCmd())
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print the version",
		Example: "  rlagent version",
		Args:    cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), "rlagent", version)
		},
	}
}

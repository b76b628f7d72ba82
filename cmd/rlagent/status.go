package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

func newStatusCmd() *cobra.Command {
	var (
		config string
		pinDir string
		output string
		watch  bool
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show each limit's count, share and traffic, read from the pinned maps",
		Long: `status reads the pinned maps directly, so it works while the agent is down. For each limit
it shows the global rate, the observed replica count and its age, the node's share, and the
admitted, dropped and would-drop (shadow) packets per second since the agent's last
snapshot (taken every second while it runs). Under the limits (table output) it shows the data
path's own counters since its maps were created (packets whose transport header could not be
found, fragments, protected packets, packets matching more limits than are checked), whether
an agent holds the pin directory, and each interface's attach state (attached native or
generic, missing, failed, or detached when the kernel says the pinned link is dead).`,
		Example: `  rlagent status
  rlagent status --output json
  rlagent status --pin-dir /sys/fs/bpf/rlagent --watch`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" {
				return fmt.Errorf("--output: %q is not one of table, json", output)
			}
			if pinDir == "" {
				pinDir = pinDirOf(config)
			}
			for {
				st, err := agent.ReadStatus(pinDir)
				if errors.Is(err, maps.ErrNotPinned) {
					return fmt.Errorf("no rlagent data path pinned in %s: is the agent running with this pin directory?", pinDir)
				}
				if err != nil {
					return err
				}
				if watch && output == "table" {
					fmt.Fprint(cmd.OutOrStdout(), "\033[H\033[2J")
				}
				if err := printStatus(cmd.OutOrStdout(), st, output); err != nil {
					return err
				}
				if output == "table" {
					g, err := agent.ReadGlobalStats(pinDir)
					if err != nil {
						return err
					}
					printGlobal(cmd.OutOrStdout(), g)
					if err := printAgentStatus(cmd.OutOrStdout(), pinDir); err != nil {
						return err
					}
				}
				if !watch {
					return nil
				}
				select {
				case <-cmd.Context().Done():
					return nil
				case <-time.After(time.Second):
				}
			}
		},
	}
	cmd.Flags().StringVarP(&config, "config", "c", defaultConfig, "config file, to find the pin directory")
	cmd.Flags().StringVar(&pinDir, "pin-dir", "", "pin directory (default: the config's pinDir, or "+v1alpha1.DefaultPinDir+")")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json")
	cmd.Flags().BoolVarP(&watch, "watch", "w", false, "refresh every second")
	return cmd
}

// pinDirOf reads the pin directory from the config, or the default.
func pinDirOf(config string) string {
	if c, err := v1alpha1.LoadConfig(config); err == nil {
		return c.PinDir
	}
	return v1alpha1.DefaultPinDir
}

func printStatus(w io.Writer, st []agent.LimitStatus, output string) error {
	if output == "json" {
		if st == nil {
			st = []agent.LimitStatus{}
		}
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "LIMIT\tSCOPE\tGLOBAL\tREPLICAS\tAGE\tSHARE\tADMIT/S\tDROP/S\tSHADOW/S\tKEYS\tSTATE\t")
	for _, s := range st {
		age := "-"
		if s.ObservationAge >= 0 {
			age = (time.Duration(s.ObservationAge * float64(time.Second))).Round(100 * time.Millisecond).String()
		}
		if s.Stale {
			age += " (stale)"
		}
		keys := "-"
		if s.Keys > 0 || s.Totals.NewKeys > 0 {
			keys = strconv.Itoa(s.Keys)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d %s/s\t%d\t%s\t%d/s\t%.0f\t%.0f\t%.0f\t%s\t%s\t\n",
			s.Name, s.Scope, s.GlobalRate, s.Unit, s.Replicas, age, s.ShareRate,
			s.AdmittedPerSecond, s.DroppedPerSecond, s.ShadowPerSecond, keys, s.State)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	// Why a limit is clamped or not applied, under the table; what the
	// paced limits delayed.
	for _, s := range st {
		if s.Note != "" {
			fmt.Fprintf(w, "%s %s: %s\n", s.Name, s.State, s.Note)
		}
	}
	for _, s := range st {
		if s.Action != maps.Pace.String() {
			continue
		}
		t := s.Totals
		mean := time.Duration(0)
		if t.PacedPackets > 0 {
			mean = time.Duration(t.PacedDelayNs / t.PacedPackets)
		}
		fmt.Fprintf(w, "%s paced: %d packets delayed, by %v on average and %v at most; %d dropped beyond the horizon\n",
			s.Name, t.PacedPackets, mean.Round(time.Microsecond), time.Duration(t.PacedDelayMaxNs).Round(time.Microsecond),
			t.HorizonDrops)
	}
	return nil
}

// printGlobal prints the data path's counters that belong to no limit, on
// one line: totals since the maps were created.
func printGlobal(w io.Writer, g maps.GlobalStats) {
	fmt.Fprintf(w, "data path: l4-unknown %d, fragments %d first / %d unseen, protected %d, "+
		"match overflow %d (fail closed %d), pool full %d, lease contended %d, key cache bypass %d, "+
		"rejects answered %d rst / %d icmp, unanswered %d over budget / %d over a destination's budget / "+
		"%d not local / %d unanswerable, endpoint source mismatch %d\n",
		g.L4Unknown, g.FragFirst, g.FragUnseen, g.Protected, g.MatchOverflow, g.FailClosed,
		g.PoolFull, g.LeaseContended, g.CacheBypass, g.RejectRST, g.RejectICMP, g.RejectBudget, g.RejectDestBudget,
		g.RejectNotLocal, g.RejectUnanswered, g.EndpointSrcMismatch)
}

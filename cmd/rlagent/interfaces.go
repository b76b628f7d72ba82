package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/rlagent/rlagent/agent"
)

// printAgentStatus prints, under the limits, who holds the pin directory
// and each interface's attach state (rlagent status, table output).
func printAgentStatus(w io.Writer, pinDir string) error {
	st, err := agent.ReadAgentStatus(pinDir)
	if err != nil {
		return err
	}
	fmt.Fprintln(w)
	switch {
	case st.Running && st.Holder != nil:
		fmt.Fprintf(w, "agent: running, %s\n", st.Holder)
	case st.Running:
		fmt.Fprintln(w, "agent: running (no record)")
	case st.Holder != nil:
		fmt.Fprintf(w, "agent: not running (last: %s); the pinned data path enforces the last shares\n", st.Holder)
	default:
		fmt.Fprintln(w, "agent: not running; the pinned data path enforces the last shares")
	}
	if len(st.Interfaces) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "INTERFACE\tHOOK\tPROGRAM\tSTATE\tMODE\tSINCE\tERROR")
	dash := func(s string) string {
		if s == "" {
			return "-"
		}
		return s
	}
	for _, s := range st.Interfaces {
		since, name := "-", s.Name
		if !s.Since.IsZero() {
			since = s.Since.Local().Format(time.DateTime)
		}
		if s.Netns != "" {
			name += " (netns " + s.Netns + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", name, dash(s.Hook), dash(s.Program), s.State, dash(s.Mode),
			since, s.Error)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	// Where paced limits leave: does the qdisc hold their packets?
	for _, s := range st.Interfaces {
		switch {
		case s.PaceIneffective != "":
			fmt.Fprintf(w, "%s: pace ineffective: %s\n", s.Name, s.PaceIneffective)
		case s.Qdisc != "":
			fmt.Fprintf(w, "%s: paced limits held to their departure times by %s\n", s.Name, s.Qdisc)
		}
	}
	return nil
}

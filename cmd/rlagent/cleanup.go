package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/rlagent/rlagent/agent"
)

func newCleanupCmd() *cobra.Command {
	var config, pinDir string
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Detach the data path and remove its pins",
		Long: `cleanup detaches every XDP and TC link pinned by rlagent and removes the pinned maps. Traffic
then passes unlimited. Stop the agent first, or it keeps its own copies attached until it exits.`,
		Example: `  rlagent cleanup
  rlagent cleanup --pin-dir /sys/fs/bpf/rlagent`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if pinDir == "" {
				pinDir = pinDirOf(config)
			}
			if err := agent.Cleanup(pinDir); err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), "removed", pinDir)
			return nil
		},
	}
	cmd.Flags().StringVarP(&config, "config", "c", defaultConfig, "config file, to find the pin directory")
	cmd.Flags().StringVar(&pinDir, "pin-dir", "", "pin directory (default: the config's pinDir)")
	return cmd
}

package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/api/v1alpha1"
)

func newValidateCmd() *cobra.Command {
	var config string
	cmd := &cobra.Command{
		Use:   "validate",
		Short: "Check a config file as the agent would load it, changing nothing",
		Long: `validate checks a config file with the agent's own code, without a kernel and without
touching a running agent: the strict decoding, the defaults and the validation of the file
(docs/config.md), then what the agent checks against its data path (at most 128 limits, the
prefix tables' size).

It prints every problem, one line each, and exits 1; or "valid" and exits 0. Warnings, such
as packets that can match more limits than the data path checks on one packet, are printed
either way and do not make a file invalid. "rlagent limits set" and "delete" run the same
checks before they write.`,
		Example: `  rlagent validate --config /etc/rlagent/rlagent.yaml
  rlagent validate -c rlagent.yaml && cp rlagent.yaml /etc/rlagent/rlagent.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			data, err := v1alpha1.ReadConfigFile(config)
			if err != nil {
				return err
			}
			_, warnings, err := checkConfig(data)
			printWarnings(cmd.ErrOrStderr(), warnings)
			if err != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "%s: %v\n", config, listErrors(err))
				return exitCode(1)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: valid\n", config)
			return nil
		},
	}
	cmd.Flags().StringVarP(&config, "config", "c", defaultConfig, "config file to check")
	return cmd
}

// checkConfig checks a config file's contents as the agent loads them:
// v1alpha1.ParseConfig (decode strictly, default, validate), then
// agent.ValidateConfig (what the agent checks against its data path). It
// returns the loaded config, the warnings and every problem found. When
// the file decodes but fails validation, the agent's checks run on it too,
// so that one run lists every problem; a file that does not decode reports
// only that.
func checkConfig(data []byte) (*v1alpha1.Config, []string, error) {
	cfg, err := v1alpha1.ParseConfig(data)
	if err == nil {
		warnings, err := agent.ValidateConfig(cfg)
		if err != nil {
			return nil, warnings, err
		}
		return cfg, warnings, nil
	}
	c, derr := v1alpha1.DecodeConfig(data)
	if derr != nil {
		return nil, nil, err
	}
	c.Default()
	warnings, verr := agent.ValidateConfig(c)
	return nil, warnings, errors.Join(append(flatten(err), flatten(verr)...)...)
}

// flatten lists the errors joined in err (none for nil).
func flatten(err error) []error {
	if err == nil {
		return nil
	}
	j, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return []error{err}
	}
	var out []error
	for _, e := range j.Unwrap() {
		out = append(out, flatten(e)...)
	}
	return out
}

// listErrors puts several joined errors one to a line under a count, as the
// agent logs a rejected config; a single error stays as it is.
func listErrors(err error) error {
	if el := flatten(err); len(el) > 1 {
		return fmt.Errorf("%d errors:\n%w", len(el), errors.Join(el...))
	}
	return err
}

func printWarnings(w io.Writer, warnings []string) {
	for _, s := range warnings {
		fmt.Fprintln(w, "warning:", s)
	}
}

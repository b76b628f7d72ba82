package main

import (
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

func newLimitsCmd() *cobra.Command {
	var (
		config string
		kube   kubeFlags
	)
	cmd := &cobra.Command{
		Use:   "limits",
		Short: "Edit and read the limits in the config file",
		Long: `limits edits the limits of the config file. Every change is checked as the agent checks
a config it loads (rlagent validate), written to a temporary file and renamed over the
config, so the file is never half-written and a change the agent would reject leaves it
untouched. Warnings (such as more limits matching one packet than the data path checks)
are printed and do not stop the change. A running agent picks the change up within a second.
With --dry-run, set and delete print the file they would write and write nothing.

With --kubeconfig (or in a pod) the limits are RateLimit objects in the cluster instead, and
the API server validates them: its errors are shown as they are. --dry-run is then the API
server's dry run: it validates and stores nothing.`,
		Example: `  rlagent limits list
  rlagent limits set dns --rate 20000 --protocol udp --dst-ports 53
  rlagent limits set dns --rate 30000 --protocol udp --dst-ports 53 --dry-run
  rlagent limits get dns
  rlagent limits delete dns
  rlagent limits set dns --rate 100000 --scope nodes --protocol udp --dst-ports 53 --kubeconfig ~/.kube/config`,
	}
	cmd.PersistentFlags().StringVarP(&config, "config", "c", defaultConfig, "config file to edit (outside a cluster)")
	kube.register(cmd)
	cmd.AddCommand(newLimitsSetCmd(&config, &kube), newLimitsGetCmd(&config, &kube), newLimitsListCmd(&config, &kube), newLimitsDeleteCmd(&config, &kube))
	return cmd
}

func newLimitsSetCmd(config *string, kube *kubeFlags) *cobra.Command {
	var (
		spec     v1alpha1.RateLimitSpec
		burst    uint64
		unit     string
		key      string
		prefix4  uint8
		prefix6  uint8
		action   string
		scope    string
		dir      string
		proto    string
		dryRun   bool
		attachTo string
		horizon  time.Duration
		share    string
		podSel   string
		nsSel    string
	)
	cmd := &cobra.Command{
		Use:   "set NAME",
		Short: "Create a limit, or replace the one with this name",
		Long: `set creates the named limit, or replaces it whole: flags not given take their defaults,
not the old values. --rate is the global rate over all replicas; each node enforces
rate / replicas.`,
		Example: `  # 20,000 DNS packets per second over all replicas
  rlagent limits set dns --rate 20000 --protocol udp --dst-ports 53
  # 1 MB/s per source /24, from two networks, in shadow mode first
  rlagent limits set per-source --rate 1000000 --unit bytes --key src-prefix --prefix-v4 24 \
      --src-cidrs 10.0.0.0/8,192.168.0.0/16 --action shadow
  # 100 Mbit/s of backups leaving the uplinks, paced (delayed, not dropped) for up to 200 ms
  rlagent limits set backup --rate 12500000 --unit bytes --burst 1000000 --direction egress \
      --protocol tcp --dst-cidrs 10.20.0.0/16 --action pace --horizon 200ms
  # 5,000 new connections per second to the web pods of the prod namespaces, except the canaries
  rlagent limits set web --rate 5000 --unit connections --protocol tcp --dst-ports 443 --scope pods \
      --pod-selector 'app=web,!canary' --namespace-selector 'env in (prod)' --kubeconfig ~/.kube/config`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			spec.Unit = v1alpha1.Unit(unit)
			spec.Key = v1alpha1.Key(key)
			spec.Action = v1alpha1.Action(action)
			spec.Share = v1alpha1.Share(share)
			spec.Scope = v1alpha1.Scope(scope)
			spec.Match.Direction = v1alpha1.Direction(dir)
			spec.Attach = v1alpha1.Attach(attachTo)
			spec.Match.Protocol = v1alpha1.Protocol(proto)
			if cmd.Flags().Changed("burst") {
				spec.Burst = &burst
			}
			if cmd.Flags().Changed("prefix-v4") || cmd.Flags().Changed("prefix-v6") {
				spec.PrefixLength = &v1alpha1.PrefixLength{IPv4: prefix4, IPv6: prefix6}
			}
			if cmd.Flags().Changed("horizon") {
				spec.Horizon = &metav1.Duration{Duration: horizon}
			}
			var err error
			if spec.Match.PodSelector, err = selectorFlag(cmd, "pod-selector", podSel); err != nil {
				return err
			}
			if spec.Match.NamespaceSelector, err = selectorFlag(cmd, "namespace-selector", nsSel); err != nil {
				return err
			}
			if rc, err := kube.config(); err != nil {
				return err
			} else if rc != nil {
				if spec.Scope == "" {
					scopes := make([]string, len(v1alpha1.Scopes))
					for i, s := range v1alpha1.Scopes {
						scopes[i] = string(s)
					}
					return fmt.Errorf("--scope: required in a cluster: one of %s", strings.Join(scopes, ", "))
				}
				obj, err := kubeSet(cmd.Context(), rc, args[0], &spec, dryRun)
				if err == nil && spec.Scope == v1alpha1.ScopePods {
					printWarnings(cmd.ErrOrStderr(), []string{"scope pods: pods with hostNetwork never match (they have no interface of their own) and are not counted; " +
						"the Accepted condition names those the selectors choose (kubectl get rl " + args[0] + " -o yaml)"})
				}
				if err != nil || !dryRun {
					return err
				}
				unstructured.RemoveNestedField(obj.Object, "metadata", "managedFields")
				out, err := yaml.Marshal(obj.Object)
				if err != nil {
					return err
				}
				cmd.OutOrStdout().Write(out)
				fmt.Fprintf(cmd.ErrOrStderr(), "dry run: RateLimit %s valid, not stored\n", args[0])
				return nil
			}
			return editConfig(cmd, *config, dryRun, func(c *v1alpha1.Config) error {
				l := v1alpha1.Limit{Name: args[0], RateLimitSpec: spec}
				if i := slices.IndexFunc(c.Limits, func(l v1alpha1.Limit) bool { return l.Name == args[0] }); i >= 0 {
					c.Limits[i] = l
				} else {
					c.Limits = append(c.Limits, l)
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.Uint64Var(&spec.Rate, "rate", 0, "global rate over all replicas, units per second (required)")
	f.Uint64Var(&burst, "burst", 0, "global burst, units (default rate/10, at least 1)")
	f.StringVar(&unit, "unit", "packets", "what a token is worth: packets, bytes, connections (TCP SYNs)")
	f.StringVar(&key, "key", "none", "how traffic splits into buckets: none, src-ip, dst-ip, src-prefix, dst-prefix, dst-port")
	f.Uint8Var(&prefix4, "prefix-v4", 0, "with --key src-prefix or dst-prefix: IPv4 prefix length (default 24)")
	f.Uint8Var(&prefix6, "prefix-v6", 0, "with --key src-prefix or dst-prefix: IPv6 prefix length (default 64)")
	f.StringVar(&attachTo, "attach", "", "where the limit is enforced: uplink (the config's interfaces), endpoints (each local endpoint's interface; the endpoints are the Service's with --scope service, the matching pods' with --scope pods, else the --dst-cidrs of an ingress limit or the --src-cidrs of an egress one); default endpoints with --scope service or pods, else uplink")
	f.StringVar(&action, "action", "drop", "over the limit: drop, shadow (count and pass), pace (delay until the tokens accrue; --direction egress at the uplinks only, and the uplinks need the fq qdisc: see the config's manageQdisc), reject (drop, and answer a TCP SYN with a RST and a UDP datagram with an ICMP port unreachable, within the config's rejectBudget; --direction ingress; at --attach endpoints dropped unanswered)")
	f.DurationVar(&horizon, "horizon", 0, "with --action pace: the longest a packet may wait, 1ms..4s; beyond it the packet is dropped (default 100ms)")
	f.StringVar(&scope, "scope", "", "how the rate is divided: static (by the config's count; the default in a file); in a cluster also nodes (by the ready agents), service (by the Service's ready endpoints, --service), pods (by the ready pods --pod-selector and --namespace-selector choose)")
	f.StringVar(&share, "share", "equal", "in a cluster, how the rate is divided among the nodes: equal (by the count), demand (by what each node asks for; --scope nodes, service or pods, --key none; see docs/kubernetes.md)")
	f.StringVar(&spec.Match.Service, "service", "", "with --scope service: the Service, namespace/name")
	f.StringVar(&podSel, "pod-selector", "", "with --scope pods: the pods' labels, as kubectl takes them (app=web,tier in (a,b),!canary; '' is every pod), in every namespace or in those --namespace-selector chooses")
	f.StringVar(&nsSel, "namespace-selector", "", "with --scope pods: the namespaces' labels, in the same syntax; the pods in them match (those --pod-selector chooses, if given)")
	f.StringVar(&dir, "direction", "ingress", "match: ingress, egress")
	f.StringVar(&proto, "protocol", "any", "match: any, tcp, udp, icmp")
	f.StringSliceVar(&spec.Match.DstPorts, "dst-ports", nil, "match: destination ports or ranges, e.g. 53,8000-8080")
	f.StringSliceVar(&spec.Match.SrcCIDRs, "src-cidrs", nil, "match: source CIDRs (IPv4 or IPv6)")
	f.StringSliceVar(&spec.Match.DstCIDRs, "dst-cidrs", nil, "match: destination CIDRs (IPv4 or IPv6)")
	f.BoolVar(&dryRun, "dry-run", false, "check the change and print the file it would write; write nothing")
	cmd.MarkFlagRequired("rate")
	return cmd
}

func newLimitsGetCmd(config *string, kube *kubeFlags) *cobra.Command {
	return &cobra.Command{
		Use:     "get NAME",
		Short:   "Print one limit as YAML",
		Example: "  rlagent limits get dns",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if rc, err := kube.config(); err != nil {
				return err
			} else if rc != nil {
				return kubeGet(cmd.Context(), rc, args[0], cmd.OutOrStdout())
			}
			c, err := v1alpha1.LoadConfig(*config)
			if err != nil {
				return err
			}
			for _, l := range c.Limits {
				if l.Name == args[0] {
					out, err := yaml.Marshal(l)
					if err != nil {
						return err
					}
					_, err = cmd.OutOrStdout().Write(out)
					return err
				}
			}
			return fmt.Errorf("limit %q: not in %s (limits: %s)", args[0], *config, names(c))
		},
	}
}

func newLimitsListCmd(config *string, kube *kubeFlags) *cobra.Command {
	return &cobra.Command{
		Use:     "list",
		Short:   "List the limits of the config file",
		Example: "  rlagent limits list --config rlagent.yaml",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rc, err := kube.config(); err != nil {
				return err
			} else if rc != nil {
				return kubeList(cmd.Context(), rc, cmd.OutOrStdout())
			}
			c, err := v1alpha1.LoadConfig(*config)
			if err != nil {
				return err
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tRATE\tBURST\tUNIT\tKEY\tSCOPE\tACTION\tATTACH\tMATCH")
			for _, l := range c.Limits {
				fmt.Fprintf(w, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", l.Name, l.Rate, l.EffectiveBurst(), l.Unit, l.Key, l.Scope, l.Action, l.Attach, matchString(&l.Match))
			}
			return w.Flush()
		},
	}
}

func newLimitsDeleteCmd(config *string, kube *kubeFlags) *cobra.Command {
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "delete NAME",
		Short: "Remove a limit from the config file",
		Example: `  rlagent limits delete dns
  rlagent limits delete dns --dry-run`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if rc, err := kube.config(); err != nil {
				return err
			} else if rc != nil {
				if err := kubeDelete(cmd.Context(), rc, args[0], dryRun); err != nil || !dryRun {
					return err
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "dry run: RateLimit %s would be deleted, not deleted\n", args[0])
				return nil
			}
			return editConfig(cmd, *config, dryRun, func(c *v1alpha1.Config) error {
				i := slices.IndexFunc(c.Limits, func(l v1alpha1.Limit) bool { return l.Name == args[0] })
				if i < 0 {
					return fmt.Errorf("limit %q: not in %s (limits: %s)", args[0], *config, names(c))
				}
				c.Limits = slices.Delete(c.Limits, i, i+1)
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "check the change and print the file it would write; write nothing")
	return cmd
}

// editConfig reads the config as written (no defaults filled in), changes
// it, and checks the result as the agent would load it (checkConfig): a
// file the agent would reject is never written. Warnings go to stderr.
// With dryRun the file that would be written goes to stdout instead of
// replacing the config; otherwise it is replaced atomically.
//
// The file is locked (v1alpha1.LockConfig) from the read to the write, so
// that concurrent edits, in this process or others, each see the one
// before: none is lost.
func editConfig(cmd *cobra.Command, path string, dryRun bool, change func(*v1alpha1.Config) error) error {
	unlock, err := v1alpha1.LockConfig(path)
	if err != nil {
		return err
	}
	defer unlock()
	data, err := v1alpha1.ReadConfigFile(path)
	if err != nil {
		return err
	}
	c, err := v1alpha1.DecodeConfig(data)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := change(c); err != nil {
		return err
	}
	out, err := c.Marshal()
	if err != nil {
		return err
	}
	_, warnings, err := checkConfig(out)
	printWarnings(cmd.ErrOrStderr(), warnings)
	if err != nil {
		return fmt.Errorf("%s unchanged: %w", path, listErrors(err))
	}
	if dryRun {
		if _, err := cmd.OutOrStdout().Write(out); err != nil {
			return err
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "dry run: %s not written\n", path)
		return nil
	}
	if err := v1alpha1.WriteConfigAtomic(path, c); err != nil {
		return fmt.Errorf("%s unchanged: %w", path, err)
	}
	return nil
}

// selectorSyntax is the syntax of --pod-selector and --namespace-selector,
// shown when one does not parse. != is not in it: a LabelSelector has no
// such operator (key notin (v) says the same).
const selectorSyntax = "key=value, key in (v1,v2), key notin (v1,v2), key (has the label), !key (has not), joined by commas: app=web,tier in (a,b),!canary"

// selectorFlag parses the label selector given to the flag name (kubectl's
// syntax, parsed by apimachinery as kubectl does), or returns nil when the
// flag is not given: an empty one is {}, every pod or namespace.
func selectorFlag(cmd *cobra.Command, name, value string) (*metav1.LabelSelector, error) {
	if !cmd.Flags().Changed(name) {
		return nil, nil
	}
	sel, err := metav1.ParseToLabelSelector(value)
	if err != nil {
		return nil, fmt.Errorf("--%s: %w; a label selector is %s", name, err, selectorSyntax)
	}
	return sel, nil
}

func names(c *v1alpha1.Config) string {
	if len(c.Limits) == 0 {
		return "none"
	}
	var n []string
	for _, l := range c.Limits {
		n = append(n, l.Name)
	}
	return strings.Join(n, ", ")
}

func matchString(m *v1alpha1.Match) string {
	parts := []string{string(m.Direction), string(m.Protocol)}
	if len(m.DstPorts) > 0 {
		parts = append(parts, "port "+strings.Join(m.DstPorts, ","))
	}
	if len(m.SrcCIDRs) > 0 {
		parts = append(parts, "from "+strings.Join(m.SrcCIDRs, ","))
	}
	if len(m.DstCIDRs) > 0 {
		parts = append(parts, "to "+strings.Join(m.DstCIDRs, ","))
	}
	if m.Service != "" {
		parts = append(parts, "service "+m.Service)
	}
	if m.SelectsPods() {
		parts = append(parts, "pods "+selectorString(m.PodSelector))
		if m.NamespaceSelector != nil {
			parts = append(parts, "in namespaces "+selectorString(m.NamespaceSelector))
		}
	}
	return strings.Join(parts, " ")
}

// selectorString is a label selector in kubectl's syntax. {} and a nil
// podSelector beside a namespaceSelector choose every pod, which
// FormatLabelSelector would print as "<none>": the opposite.
func selectorString(sel *metav1.LabelSelector) string {
	if sel == nil || len(sel.MatchLabels) == 0 && len(sel.MatchExpressions) == 0 {
		return "(all)"
	}
	return metav1.FormatLabelSelector(sel)
}

package v1alpha1

import (
	"errors"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func ptr[T any](v T) *T { return &v }

// baseConfig is a valid, defaulted config with two limits; test cases break
// one rule each.
func baseConfig() *Config {
	c := &Config{
		Interfaces: []string{"eth0", "eth1"},
		Limits: []Limit{
			{Name: "dns", RateLimitSpec: RateLimitSpec{
				Rate:  20000,
				Match: Match{Protocol: ProtocolUDP, DstPorts: []string{"53"}},
			}},
			{Name: "per-source", RateLimitSpec: RateLimitSpec{
				Rate:  1000,
				Burst: ptr(uint64(2000)),
				Match: Match{
					Protocol: ProtocolTCP,
					DstPorts: []string{"80", "8000-8080"},
					SrcCIDRs: []string{"10.0.0.0/8", "2001:db8::/32"},
					DstCIDRs: []string{"192.0.2.1"},
				},
				Key: KeySrcPrefix,
			}},
		},
	}
	c.Default()
	return c
}

// fieldErrors unpacks a joined validation error.
func fieldErrors(t *testing.T, err error) []*FieldError {
	t.Helper()
	var out []*FieldError
	var walk func(error)
	walk = func(err error) {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
			return
		}
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("error %q is not a *FieldError", err)
		}
		out = append(out, fe)
	}
	if err != nil {
		walk(err)
	}
	return out
}

func TestValidateBase(t *testing.T) {
	if err := baseConfig().Validate(); err != nil {
		t.Fatalf("base config: %v", err)
	}
}

func TestValidateRules(t *testing.T) {
	limit := func(c *Config, i int) *RateLimitSpec { return &c.Limits[i].RateLimitSpec }
	tests := []struct {
		name   string
		change func(c *Config)
		field  string   // the path the error must name
		want   []string // substrings of its detail
	}{
		// The file.
		{"no interfaces", func(c *Config) { c.Interfaces = nil },
			"interfaces", []string{"required", "at least one"}},
		{"interface with slash", func(c *Config) { c.Interfaces[1] = "eth/0" },
			"interfaces[1]", []string{`"eth/0" is not an interface name`, "1..15 characters", "'/'"}},
		{"interface too long", func(c *Config) { c.Interfaces[0] = "abcdefghijklmnop" },
			"interfaces[0]", []string{"is not an interface name"}},
		{"interface with space", func(c *Config) { c.Interfaces[0] = "eth 0" },
			"interfaces[0]", []string{"whitespace"}},
		{"interface with colon", func(c *Config) { c.Interfaces[0] = "eth0:1" },
			"interfaces[0]", []string{"':'"}},
		{"interface dot", func(c *Config) { c.Interfaces[0] = "." },
			"interfaces[0]", []string{`not "." or ".."`}},
		{"interface empty", func(c *Config) { c.Interfaces[0] = "" },
			"interfaces[0]", []string{`"" is not an interface name`}},
		{"interface twice", func(c *Config) { c.Interfaces[1] = "eth0" },
			"interfaces[1]", []string{`"eth0" is listed twice (first at interfaces[0])`}},
		{"relative pin dir", func(c *Config) { c.PinDir = "bpf/rlagent" },
			"pinDir", []string{`"bpf/rlagent" is not an absolute path`}},
		{"metrics address without port", func(c *Config) { c.MetricsAddress = "localhost" },
			"metricsAddress", []string{`"localhost" is not "off" or host:port`}},
		{"metrics address port 0", func(c *Config) { c.MetricsAddress = "127.0.0.1:0" },
			"metricsAddress", []string{`port "0" is not a number in 1..65535`}},
		{"metrics address named port", func(c *Config) { c.MetricsAddress = "127.0.0.1:http" },
			"metricsAddress", []string{`port "http" is not a number in 1..65535`}},
		{"metrics disabled spelled wrong", func(c *Config) { c.MetricsAddress = "none" },
			"metricsAddress", []string{`is not "off" or host:port`}},
		{"secure metrics without port", func(c *Config) { c.SecureMetrics.Address = "0.0.0.0" },
			"secureMetrics.address", []string{`"0.0.0.0" is not host:port (e.g. ":9479", every address) or "" (off)`}},
		{"secure metrics named port", func(c *Config) { c.SecureMetrics.Address = ":https" },
			"secureMetrics.address", []string{`port "https" is not a number in 1..65535`}},
		{"secure metrics on the plain port", func(c *Config) { c.SecureMetrics.Address = ":9478" },
			"secureMetrics.address", []string{`metricsAddress "127.0.0.1:9478" has that port`, "a port each"}},
		{"secure metrics cert dir without address", func(c *Config) { c.SecureMetrics.CertDir = "/etc/rlagent/tls" },
			"secureMetrics.certDir", []string{"set without address"}},
		{"secure metrics relative cert dir", func(c *Config) { c.SecureMetrics = SecureMetrics{Address: ":9479", CertDir: "tls"} },
			"secureMetrics.certDir", []string{`"tls" is not an absolute path`}},
		{"max buckets too small", func(c *Config) { c.MaxBuckets = 1023 },
			"maxBuckets", []string{"1023 is not in 1024..16777216"}},
		{"max buckets too large", func(c *Config) { c.MaxBuckets = 1<<24 + 1 },
			"maxBuckets", []string{"16777217 is not in 1024..16777216"}},
		{"count both", func(c *Config) { c.Count.File = "/run/replicas" },
			"count", []string{"set one of static, file, not both"}},
		{"count neither", func(c *Config) { c.Count.Static = nil },
			"count", []string{"set one of static, file"}},
		{"count negative", func(c *Config) { c.Count.Static = ptr(int32(-1)) },
			"count.static", []string{"-1 is not a replica count", "0 or more"}},
		{"count file relative", func(c *Config) { c.Count = CountSource{File: "replicas"} },
			"count.file", []string{`"replicas" is not an absolute path`}},

		// Names.
		{"name missing", func(c *Config) { c.Limits[1].Name = "" },
			"limits[1].name", []string{"required"}},
		{"name upper case", func(c *Config) { c.Limits[0].Name = "DNS" },
			"limits[0].name", []string{`"DNS" is not a name`, "lowercase letters, digits and '-'"}},
		{"name leading dash", func(c *Config) { c.Limits[0].Name = "-dns" },
			"limits[0].name", []string{"is not a name"}},
		{"name too long", func(c *Config) { c.Limits[0].Name = strings.Repeat("a", 64) },
			"limits[0].name", []string{"is not a name", "63"}},
		{"name twice", func(c *Config) { c.Limits[1].Name = "dns" },
			"limits[1].name", []string{`"dns" is already the name of limits[0]`}},

		// Rate, unit, burst.
		{"rate missing", func(c *Config) { limit(c, 0).Rate = 0 },
			"limits[0].rate", []string{"required", "1..4000000000"}},
		{"rate too high", func(c *Config) { limit(c, 1).Rate = MaxGlobalRate + 1 },
			"limits[1].rate", []string{"4000000001 is not in 1..4000000000", "one node enforces at most 4000000000 units/s"}},
		{"unit unknown", func(c *Config) { limit(c, 0).Unit = "pkts" },
			"limits[0].unit", []string{`"pkts" is not one of packets, bytes, connections`}},
		{"unit connections with udp", func(c *Config) { limit(c, 0).Unit = UnitConnections },
			"limits[0].unit", []string{"connections counts TCP SYNs", "protocol tcp or any", `protocol is "udp"`}},
		{"burst zero", func(c *Config) { limit(c, 1).Burst = ptr(uint64(0)) },
			"limits[1].burst", []string{"0 is not a burst", "at least 1"}},
		{"burst above an hour", func(c *Config) { limit(c, 1).Burst = ptr(uint64(3600*1000 + 1)) },
			"limits[1].burst", []string{"3600001 is more than 3600 seconds of rate 1000"}},

		// Match.
		{"direction unknown", func(c *Config) { limit(c, 0).Match.Direction = "in" },
			"limits[0].match.direction", []string{`"in" is not one of ingress, egress`}},
		{"protocol unknown", func(c *Config) { limit(c, 0).Match.Protocol = "sctp" },
			"limits[0].match.protocol", []string{`"sctp" is not one of any, tcp, udp, icmp`}},
		{"ports with icmp", func(c *Config) { limit(c, 0).Match.Protocol = ProtocolICMP },
			"limits[0].match.dstPorts", []string{"protocol icmp has no ports", "tcp, udp or any"}},
		{"port above 65535", func(c *Config) { limit(c, 0).Match.DstPorts = []string{"70000"} },
			"limits[0].match.dstPorts[0]", []string{`"70000" is not a port in 0..65535`}},
		{"port not a number", func(c *Config) { limit(c, 1).Match.DstPorts[1] = "http" },
			"limits[1].match.dstPorts[1]", []string{`"http" is not a port in 0..65535`}},
		{"port range reversed", func(c *Config) { limit(c, 1).Match.DstPorts[1] = "8080-8000" },
			"limits[1].match.dstPorts[1]", []string{`"8080-8000" is not a port range: first port 8080 is above last 8000`}},
		{"port range end too high", func(c *Config) { limit(c, 1).Match.DstPorts[1] = "8000-80000" },
			"limits[1].match.dstPorts[1]", []string{`"8000-80000" is not a port range: "80000" is not a port in 0..65535`}},
		{"src cidr bad length", func(c *Config) { limit(c, 1).Match.SrcCIDRs[0] = "10.0.0.0/33" },
			"limits[1].match.srcCIDRs[0]", []string{`"10.0.0.0/33" is not an IPv4 or IPv6 CIDR or address`}},
		{"src cidr garbage", func(c *Config) { limit(c, 1).Match.SrcCIDRs[1] = "example.com" },
			"limits[1].match.srcCIDRs[1]", []string{"is not an IPv4 or IPv6 CIDR or address"}},
		{"dst cidr with zone", func(c *Config) { limit(c, 1).Match.DstCIDRs[0] = "fe80::1%eth0" },
			"limits[1].match.dstCIDRs[0]", []string{"is not an IPv4 or IPv6 CIDR or address"}},
		{"dst cidr mapped", func(c *Config) { limit(c, 1).Match.DstCIDRs[0] = "::ffff:192.0.2.1" },
			"limits[1].match.dstCIDRs[0]", []string{"IPv4-mapped", "write it as IPv4"}},
		{"service without scope service", func(c *Config) { limit(c, 0).Match.Service = "kube-system/kube-dns" },
			"limits[0].match.service", []string{`only with scope service (scope is "static")`}},
		{"service not namespace/name", func(c *Config) {
			limit(c, 0).Match.Service = "kube-dns"
			limit(c, 0).Scope = ScopeService
		}, "limits[0].match.service", []string{`"kube-dns" is not namespace/name`}},
		{"scope service without service", func(c *Config) { limit(c, 0).Scope = ScopeService },
			"limits[0].match.service", []string{"required with scope service"}},
		{"pod selector without scope pods", func(c *Config) {
			limit(c, 0).Match.PodSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}
		}, "limits[0].match.podSelector", []string{`only with scope pods (scope is "static")`}},
		{"namespace selector without scope pods", func(c *Config) {
			limit(c, 0).Match.NamespaceSelector = &metav1.LabelSelector{}
		}, "limits[0].match.namespaceSelector", []string{`only with scope pods (scope is "static")`}},
		{"scope pods without selectors", func(c *Config) { limit(c, 0).Scope = ScopePods },
			"limits[0].match.podSelector", []string{"required with scope pods", "namespaceSelector"}},
		{"pod selector bad label value", func(c *Config) {
			limit(c, 0).Scope = ScopePods
			limit(c, 0).Match.PodSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"app": "not a value!"}}
		}, "limits[0].match.podSelector.matchLabels", []string{"Invalid value", "not a value!"}},
		{"pod selector bad label key", func(c *Config) {
			limit(c, 0).Scope = ScopePods
			limit(c, 0).Match.PodSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"-app": "web"}}
		}, "limits[0].match.podSelector.matchLabels", []string{"Invalid value", "-app"}},
		{"namespace selector bad operator", func(c *Config) {
			limit(c, 0).Scope = ScopePods
			limit(c, 0).Match.NamespaceSelector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "team", Operator: "Like", Values: []string{"a"}}}}
		}, "limits[0].match.namespaceSelector.matchExpressions[0].operator", []string{`"Like"`, "not a valid selector operator"}},
		{"namespace selector In without values", func(c *Config) {
			limit(c, 0).Scope = ScopePods
			limit(c, 0).Match.NamespaceSelector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "team", Operator: metav1.LabelSelectorOpIn}}}
		}, "limits[0].match.namespaceSelector.matchExpressions[0].values", []string{"must be specified when `operator` is 'In' or 'NotIn'"}},
		{"scope pods with service", func(c *Config) {
			limit(c, 0).Scope = ScopePods
			limit(c, 0).Match.PodSelector = &metav1.LabelSelector{}
			limit(c, 0).Match.Service = "shop/web"
		}, "limits[0].match.service", []string{`only with scope service (scope is "pods")`}},

		// Key and prefix length.
		{"key unknown", func(c *Config) { limit(c, 0).Key = "source" },
			"limits[0].key", []string{`"source" is not one of none, src-ip, dst-ip, src-prefix, dst-prefix, dst-port`}},
		{"key dst-port with icmp", func(c *Config) {
			limit(c, 0).Match = Match{Direction: DirectionIngress, Protocol: ProtocolICMP}
			limit(c, 0).Key = KeyDstPort
		}, "limits[0].key", []string{"dst-port needs protocol tcp, udp or any"}},
		{"prefix length without src-prefix", func(c *Config) { limit(c, 0).PrefixLength = &PrefixLength{IPv4: 24, IPv6: 64} },
			"limits[0].prefixLength", []string{`only with key src-prefix or dst-prefix (key is "none")`}},
		{"prefix length ipv4 too long", func(c *Config) { limit(c, 1).PrefixLength.IPv4 = 33 },
			"limits[1].prefixLength.ipv4", []string{"33 is not in 1..32"}},
		{"prefix length ipv6 too long", func(c *Config) { limit(c, 1).PrefixLength.IPv6 = 129 },
			"limits[1].prefixLength.ipv6", []string{"129 is not in 1..128"}},

		// Scope and action.
		{"scope unknown", func(c *Config) { limit(c, 0).Scope = "global" },
			"limits[0].scope", []string{`"global" is not one of static, nodes, service`}},
		{"scope nodes in the file", func(c *Config) { limit(c, 0).Scope = ScopeNodes },
			"limits[0].scope", []string{`"nodes" needs the Kubernetes watcher (run rlagent in a cluster)`}},
		{"scope service in the file", func(c *Config) {
			limit(c, 0).Scope = ScopeService
			limit(c, 0).Match.Service = "kube-system/kube-dns"
		}, "limits[0].scope", []string{`"service" needs the Kubernetes watcher`}},
		{"action unknown", func(c *Config) { limit(c, 0).Action = "refuse" },
			"limits[0].action", []string{`"refuse" is not one of drop, shadow, pace, reject`}},
		{"reject on egress", func(c *Config) {
			limit(c, 0).Action = ActionReject
			limit(c, 0).Match.Direction = DirectionEgress
		}, "limits[0].action", []string{"reject needs match.direction ingress", `"egress"`, "arriving packets"}},
		{"reject with a horizon", func(c *Config) {
			limit(c, 0).Action = ActionReject
			limit(c, 0).Horizon = &metav1.Duration{Duration: time.Second}
		}, "limits[0].horizon", []string{`only with action pace (action is "reject")`}},
		{"reject budget above the most", func(c *Config) { c.RejectBudget.Rate = ptr(uint32(100_001)) },
			"rejectBudget.rate", []string{"100001 is not in 0..100000"}},
		{"reject burst above the rate", func(c *Config) {
			c.RejectBudget.Rate, c.RejectBudget.Burst = ptr(uint32(10)), ptr(uint32(11))
		}, "rejectBudget.burst", []string{"11 is not in 1..10"}},
		{"reject burst 0", func(c *Config) { c.RejectBudget.Burst = ptr(uint32(0)) },
			"rejectBudget.burst", []string{"0 is not in 1..1000"}},
		{"reject per destination 0", func(c *Config) { c.RejectBudget.PerDestination.Rate = ptr(uint32(0)) },
			"rejectBudget.perDestination.rate", []string{"0 is not in 1..100000"}},
		{"reject per destination burst above its rate", func(c *Config) {
			c.RejectBudget.PerDestination.Rate, c.RejectBudget.PerDestination.Burst = ptr(uint32(5)), ptr(uint32(6))
		}, "rejectBudget.perDestination.burst", []string{"6 is not in 1..5"}},
		{"pace on ingress", func(c *Config) { limit(c, 0).Action = ActionPace },
			"limits[0].action", []string{"pace needs match.direction egress", "EDT timestamps", "ingress packets cannot be delayed"}},
		{"pace at the endpoints", func(c *Config) {
			limit(c, 0).Action = ActionPace
			limit(c, 0).Match.Direction = DirectionEgress
			limit(c, 0).Attach = AttachEndpoints
			limit(c, 0).Match.SrcCIDRs = []string{"10.0.0.0/24"}
		}, "limits[0].action", []string{"pace needs attach uplink", `"endpoints"`, "fq"}},
		{"pace horizon too short", func(c *Config) {
			limit(c, 0).Action = ActionPace
			limit(c, 0).Match.Direction = DirectionEgress
			limit(c, 0).Horizon = &metav1.Duration{Duration: time.Microsecond}
		}, "limits[0].horizon", []string{"1µs is not in 1ms..4s"}},
		{"pace horizon too long", func(c *Config) {
			limit(c, 0).Action = ActionPace
			limit(c, 0).Match.Direction = DirectionEgress
			limit(c, 0).Horizon = &metav1.Duration{Duration: 5 * time.Second}
		}, "limits[0].horizon", []string{"5s is not in 1ms..4s"}},
		{"horizon without pace", func(c *Config) {
			limit(c, 0).Horizon = &metav1.Duration{Duration: time.Second}
		}, "limits[0].horizon", []string{`only with action pace (action is "drop")`}},

		// Share.
		{"share unknown", func(c *Config) { limit(c, 0).Share = "fair" },
			"limits[0].share", []string{`"fair" is not one of equal, demand`}},
		{"share demand with scope static", func(c *Config) { limit(c, 0).Share = ShareDemand },
			"limits[0].share", []string{"demand needs scope nodes, service or pods", `"static"`}},
		{"demand interval too short", func(c *Config) { c.DemandShares.Interval = &metav1.Duration{Duration: time.Millisecond} },
			"demandShares.interval", []string{"1ms is not in 1s..10m0s"}},
		{"demand stale age below 3 intervals", func(c *Config) { c.DemandShares.StaleAfter = &metav1.Duration{Duration: 30 * time.Second} },
			"demandShares.staleAfter", []string{"30s is not in 45s..1h0m0s", "at least 3 intervals (interval is 15s)"}},
		{"demand floor above 2%", func(c *Config) { c.DemandShares.FloorPerMille = ptr(uint32(21)) },
			"demandShares.floorPerMille", []string{"21 is not in 0..20"}},

		// Attach.
		{"attach unknown", func(c *Config) { limit(c, 0).Attach = "pod" },
			"limits[0].attach", []string{`"pod" is not one of endpoints, uplink`}},
		{"attach endpoints without dstCIDRs", func(c *Config) { limit(c, 0).Attach = AttachEndpoints },
			"limits[0].attach", []string{"match.dstCIDRs", "ingress", "attach uplink"}},
		{"attach endpoints egress without srcCIDRs", func(c *Config) {
			limit(c, 0).Attach = AttachEndpoints
			limit(c, 0).Match.Direction = DirectionEgress
			limit(c, 0).Match.DstCIDRs = []string{"10.0.0.1"}
		}, "limits[0].attach", []string{"match.srcCIDRs", "egress"}},
		{"xdp fallback unknown", func(c *Config) { c.XDPFallback = "generic" },
			"xdpFallback", []string{`"generic" is not one of none, tc`}},
		{"endpoint hook unknown", func(c *Config) { c.EndpointHook = "peer" },
			"endpointHook", []string{`"peer" is not one of host, pod`}},
		{"endpoint source check unknown", func(c *Config) { c.EndpointSourceCheck = "reject" },
			"endpointSourceCheck", []string{`"reject" is not one of count, drop`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := baseConfig()
			tt.change(c)
			errs := fieldErrors(t, c.Validate())
			var found *FieldError
			for _, e := range errs {
				if e.Field == tt.field {
					found = e
					break
				}
			}
			if found == nil {
				t.Fatalf("no error for %s; got %v", tt.field, errs)
			}
			for _, w := range tt.want {
				if !strings.Contains(found.Error(), w) {
					t.Errorf("error %q does not contain %q", found, w)
				}
			}
			if !strings.HasPrefix(found.Error(), tt.field+": ") {
				t.Errorf("error %q does not start with its field", found)
			}
		})
	}
}

func TestValidateAccepts(t *testing.T) {
	tests := []struct {
		name   string
		change func(c *Config)
	}{
		{"metrics off", func(c *Config) { c.MetricsAddress = MetricsOff }},
		{"metrics on all addresses", func(c *Config) { c.MetricsAddress = ":9478" }},
		{"metrics on ipv6", func(c *Config) { c.MetricsAddress = "[::1]:9478" }},
		{"secure metrics", func(c *Config) { c.SecureMetrics.Address = ":9479" }},
		{"secure metrics with a cert dir", func(c *Config) {
			c.SecureMetrics = SecureMetrics{Address: "[::]:9479", CertDir: "/etc/rlagent/tls"}
		}},
		{"secure metrics on the plain port of another address", func(c *Config) { c.SecureMetrics.Address = "10.0.0.5:9478" }},
		{"secure metrics on the plain port, metrics off", func(c *Config) {
			c.MetricsAddress, c.SecureMetrics.Address = MetricsOff, ":9478"
		}},
		{"count 0", func(c *Config) { c.Count.Static = ptr(int32(0)) }},
		{"count file", func(c *Config) { c.Count = CountSource{File: "/run/rlagent/replicas"} }},
		{"no limits", func(c *Config) { c.Limits = nil }},
		{"max buckets bounds", func(c *Config) { c.MaxBuckets = MinMaxBuckets }},
		{"max buckets upper bound", func(c *Config) { c.MaxBuckets = MaxMaxBuckets }},
		{"rate at the maximum", func(c *Config) { c.Limits[0].Rate = MaxGlobalRate }},
		{"burst of an hour", func(c *Config) { c.Limits[1].Burst = ptr(uint64(3600 * 1000)) }},
		{"port 0 and 65535", func(c *Config) { c.Limits[0].Match.DstPorts = []string{"0", "65535", "1-1"} }},
		{"ports with any", func(c *Config) { c.Limits[0].Match.Protocol = ProtocolAny }},
		{"cidr with host bits", func(c *Config) { c.Limits[1].Match.SrcCIDRs[0] = "10.1.2.3/8" }},
		{"shadow", func(c *Config) { c.Limits[0].Action = ActionShadow }},
		{"bytes", func(c *Config) { c.Limits[0].Unit = UnitBytes }},
		{"egress", func(c *Config) { c.Limits[0].Match.Direction = DirectionEgress }},
		{"connections", func(c *Config) { c.Limits[1].Unit = UnitConnections }},
		{"connections with any", func(c *Config) {
			c.Limits[0].Unit = UnitConnections
			c.Limits[0].Match.Protocol = ProtocolAny
		}},
		{"dst-prefix", func(c *Config) {
			c.Limits[1].Key = KeyDstPrefix
			c.Limits[1].PrefixLength = &PrefixLength{IPv4: 16, IPv6: 48}
		}},
		{"attach endpoints", func(c *Config) { c.Limits[1].Attach = AttachEndpoints }},
		{"attach endpoints egress", func(c *Config) {
			c.Limits[1].Attach = AttachEndpoints
			c.Limits[1].Match.Direction = DirectionEgress
		}},
		{"pace", func(c *Config) {
			c.Limits[0].Action = ActionPace
			c.Limits[0].Match.Direction = DirectionEgress
		}},
		{"pace horizon bounds", func(c *Config) {
			c.ManageQdisc = true
			c.Limits[0].Action, c.Limits[1].Action = ActionPace, ActionPace
			c.Limits[0].Match.Direction, c.Limits[1].Match.Direction = DirectionEgress, DirectionEgress
			c.Limits[0].Horizon = &metav1.Duration{Duration: MinHorizon}
			c.Limits[1].Horizon = &metav1.Duration{Duration: MaxHorizon}
		}},
		{"xdp fallback tc", func(c *Config) { c.XDPFallback = XDPFallbackTC }},
		{"endpoint hook pod", func(c *Config) { c.EndpointHook = EndpointHookPod }},
		{"name of 63", func(c *Config) { c.Limits[0].Name = strings.Repeat("a", 63) }},
		{"interface of 15", func(c *Config) { c.Interfaces[0] = "veth-rlagent-01" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := baseConfig()
			tt.change(c)
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestValidateAll checks that every problem is reported at once, in the
// order of the fields.
func TestValidateAll(t *testing.T) {
	c := baseConfig()
	c.Interfaces = nil
	c.MaxBuckets = 1
	c.Limits[0].Rate = 0
	c.Limits[0].Unit = "pkts"
	c.Limits[0].Action = "refuse"
	c.Limits[1].Match.DstPorts[0] = "70000"
	c.Limits[1].Scope = ScopeNodes
	var got []string
	for _, e := range fieldErrors(t, c.Validate()) {
		got = append(got, e.Field)
	}
	want := []string{"interfaces", "maxBuckets", "limits[0].rate", "limits[0].unit", "limits[0].action",
		"limits[1].match.dstPorts[0]", "limits[1].scope"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("fields\n got %v\nwant %v", got, want)
	}
}

// TestValidateStandalone checks the scopes that need Kubernetes: Validate
// takes them, ValidateStandalone does not; and the rules of share demand
// and hotKeys, which only those scopes reach.
func TestValidateStandalone(t *testing.T) {
	for _, s := range []RateLimitSpec{
		{Rate: 10, Scope: ScopeNodes},
		{Rate: 10, Scope: ScopeService, Match: Match{Service: "default/web"}},
	} {
		s.Default()
		if err := s.Validate("spec"); err != nil {
			t.Errorf("Validate(scope %s): %v", s.Scope, err)
		}
		err := s.ValidateStandalone("spec")
		if err == nil || !strings.Contains(err.Error(), "spec.scope: ") || !strings.Contains(err.Error(), "needs the Kubernetes watcher") {
			t.Errorf("ValidateStandalone(scope %s) = %v, want spec.scope: ... needs the Kubernetes watcher", s.Scope, err)
		}
	}
	// share demand: with scope nodes or service, with or without a key.
	for _, s := range []RateLimitSpec{
		{Rate: 10, Scope: ScopeNodes, Share: ShareDemand},
		{Rate: 10, Scope: ScopeService, Share: ShareDemand, Match: Match{Service: "default/web"}},
	} {
		keyless := s
		keyless.Default()
		if err := keyless.Validate("spec"); err != nil {
			t.Errorf("Validate(share demand, scope %s): %v", s.Scope, err)
		}
		if keyless.HotKeys != nil {
			t.Errorf("Default(share demand, key none, scope %s): hotKeys %d, want none", s.Scope, *keyless.HotKeys)
		}
		keyed := s
		keyed.Key = KeySrcIP
		keyed.Default()
		if err := keyed.Validate("spec"); err != nil {
			t.Errorf("Validate(share demand, key src-ip, scope %s): %v", s.Scope, err)
		}
		if keyed.HotKeys == nil || *keyed.HotKeys != DefaultHotKeys {
			t.Errorf("Default(share demand, key src-ip, scope %s): hotKeys %v, want %d", s.Scope, keyed.HotKeys, DefaultHotKeys)
		}
	}
	// What share demand and hotKeys refuse: each case breaks one rule, and
	// its error is the only one.
	for _, tt := range []struct {
		name string
		spec RateLimitSpec
		want string
	}{
		{"demand paced with a key", RateLimitSpec{Rate: 10, Scope: ScopeNodes, Share: ShareDemand, Action: ActionPace,
			Match: Match{Direction: DirectionEgress}, Key: KeyDstIP}, `spec.share: demand with a key ("dst-ip") cannot pace`},
		{"hotKeys with share equal", RateLimitSpec{Rate: 10, Scope: ScopeNodes, Key: KeySrcIP, HotKeys: ptr(int32(16))},
			`spec.hotKeys: only allowed with share demand and a key (share is "equal", key is "src-ip")`},
		{"hotKeys without a key", RateLimitSpec{Rate: 10, Scope: ScopeNodes, Share: ShareDemand, HotKeys: ptr(int32(16))},
			`spec.hotKeys: only allowed with share demand and a key (share is "demand", key is "none")`},
		{"hotKeys 0", RateLimitSpec{Rate: 10, Scope: ScopeNodes, Share: ShareDemand, Key: KeySrcIP, HotKeys: ptr(int32(0))},
			"spec.hotKeys: 0 is not in 1..256"},
		{"hotKeys 257", RateLimitSpec{Rate: 10, Scope: ScopeNodes, Share: ShareDemand, Key: KeySrcIP, HotKeys: ptr(int32(MaxHotKeys + 1))},
			"spec.hotKeys: 257 is not in 1..256"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.spec
			s.Default()
			errs := fieldErrors(t, s.Validate("spec"))
			if len(errs) != 1 || !strings.HasPrefix(errs[0].Error(), tt.want) {
				t.Errorf("Validate = %v, want only %s", errs, tt.want)
			}
		})
	}
	// hotKeys at its bounds.
	for _, k := range []int32{1, MaxHotKeys} {
		s := RateLimitSpec{Rate: 10, Scope: ScopeNodes, Share: ShareDemand, Key: KeyDstPort, HotKeys: ptr(k)}
		s.Default()
		if err := s.Validate("spec"); err != nil {
			t.Errorf("Validate(hotKeys %d): %v", k, err)
		}
	}
	// Without a path the fields are named from the spec.
	s := RateLimitSpec{}
	s.Default()
	if err := s.Validate(""); err == nil || !strings.HasPrefix(err.Error(), "rate: required") {
		t.Errorf("Validate(\"\") = %v, want rate: required", err)
	}
}

func TestParsePortRange(t *testing.T) {
	tests := []struct {
		in          string
		first, last uint16
		err         string
	}{
		{"53", 53, 53, ""},
		{"0", 0, 0, ""},
		{"65535", 65535, 65535, ""},
		{"8000-8080", 8000, 8080, ""},
		{"80-80", 80, 80, ""},
		{"70000", 0, 0, `"70000" is not a port in 0..65535`},
		{"", 0, 0, `"" is not a port in 0..65535`},
		{"-1", 0, 0, `"-1" is not a port range: "" is not a port`},
		{"+1", 0, 0, "is not a port"},
		{" 53", 0, 0, "is not a port"},
		{"80-", 0, 0, `"80-" is not a port range: "" is not a port`},
		{"1-2-3", 0, 0, `"1-2-3" is not a port range: "2-3" is not a port`},
		{"9-8", 0, 0, "first port 9 is above last 8"},
	}
	for _, tt := range tests {
		first, last, err := ParsePortRange(tt.in)
		switch {
		case tt.err == "" && err != nil:
			t.Errorf("ParsePortRange(%q): %v", tt.in, err)
		case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
			t.Errorf("ParsePortRange(%q) = %v, want error containing %q", tt.in, err, tt.err)
		case first != tt.first || last != tt.last:
			t.Errorf("ParsePortRange(%q) = %d, %d, want %d, %d", tt.in, first, last, tt.first, tt.last)
		}
	}
}

func TestParseCIDR(t *testing.T) {
	tests := []struct {
		in, want string // want "" for an error
	}{
		{"10.0.0.0/8", "10.0.0.0/8"},
		{"10.1.2.3/8", "10.0.0.0/8"},
		{"192.0.2.1", "192.0.2.1/32"},
		{"2001:db8::1", "2001:db8::1/128"},
		{"2001:db8:1:2::/32", "2001:db8::/32"},
		{"0.0.0.0/0", "0.0.0.0/0"},
		{"::/0", "::/0"},
		{"10.0.0.0/33", ""},
		{"2001:db8::/129", ""},
		{"fe80::1%eth0", ""},
		{"::ffff:10.0.0.1", ""},
		{"::ffff:0:0/96", ""},
		{"10.0.0", ""},
		{"", ""},
	}
	for _, tt := range tests {
		p, err := ParseCIDR(tt.in)
		if tt.want == "" {
			if err == nil {
				t.Errorf("ParseCIDR(%q) = %v, want an error", tt.in, p)
			} else if !strings.Contains(err.Error(), `"`+tt.in+`"`) {
				t.Errorf("ParseCIDR(%q) error %q does not quote the input", tt.in, err)
			}
			continue
		}
		if err != nil || p.String() != tt.want {
			t.Errorf("ParseCIDR(%q) = %v, %v, want %s", tt.in, p, err, tt.want)
		}
	}
}

// TestValidateRequests: a limit with unit requests is the limiter
// library's: scope service or static, a policy instead of an attach point,
// and none of the packet path's fields. Each bad case breaks one rule, and
// its error is the only one; the CRD's CEL rules say the same
// (TestSchemaRejectsInvalid's requests cases).
func TestValidateRequests(t *testing.T) {
	svc := Match{Service: "shop/api"}
	for _, s := range []RateLimitSpec{
		{Rate: 300, Unit: UnitRequests, Scope: ScopeService, Match: svc},
		{Rate: 300, Unit: UnitRequests, Scope: ScopeService, Match: svc, Key: KeyCustom, OnEmpty: OnEmptyWait},
		{Rate: 300, Unit: UnitRequests, Scope: ScopeStatic, Key: KeySrcPrefix, Action: ActionShadow},
	} {
		s.Default()
		if err := s.Validate("spec"); err != nil {
			t.Errorf("Validate(%+v): %v", s, err)
		}
		if s.Attach != "" {
			t.Errorf("Default(unit requests) set attach %q: no node installs it", s.Attach)
		}
		if s.OnEmpty == "" {
			t.Errorf("Default(unit requests) left onEmpty empty, want %s", OnEmptyFail)
		}
		if (s.MaxWait != nil) != (s.OnEmpty == OnEmptyWait) || s.MaxWait != nil && s.MaxWait.Duration != DefaultMaxWait {
			t.Errorf("Default(onEmpty %s): maxWait %v, want %v only with wait", s.OnEmpty, s.MaxWait, DefaultMaxWait)
		}
	}
	ms := func(d time.Duration) *metav1.Duration { return &metav1.Duration{Duration: d} }
	for _, tt := range []struct {
		name string
		spec RateLimitSpec
		want string
	}{
		{"onEmpty with packets", RateLimitSpec{Rate: 10, Scope: ScopeNodes, OnEmpty: OnEmptyWait},
			`spec.onEmpty: only with unit requests (unit is "packets")`},
		{"maxWait with fail", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, OnEmpty: OnEmptyFail, MaxWait: ms(time.Second)},
			`spec.maxWait: only with onEmpty wait (onEmpty is "fail")`},
		{"maxWait too long", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, OnEmpty: OnEmptyWait, MaxWait: ms(2 * time.Minute)},
			"spec.maxWait: 2m0s is not in 1ms..1m0s"},
		{"onEmpty unknown", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, OnEmpty: "queue"},
			`spec.onEmpty: "queue" is not one of fail, wait`},
		{"key custom with packets", RateLimitSpec{Rate: 10, Scope: ScopeNodes, Key: KeyCustom},
			`spec.key: custom is only allowed with unit requests (unit is "packets")`},
		{"scope nodes", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeNodes},
			"spec.scope: unit requests is enforced in the Service's own processes"},
		{"key dst-ip", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, Key: KeyDstIP},
			`spec.key: "dst-ip" is not one of none, src-ip, src-prefix, custom`},
		{"action reject", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, Action: ActionReject},
			`spec.action: unit requests allows action drop or shadow (action is "reject")`},
		{"share demand", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeService, Match: svc, Share: ShareDemand},
			`spec.share: unit requests allows share equal only (share is "demand")`},
		{"attach", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, Attach: AttachUplink},
			`spec.attach: not allowed with unit requests (attach is "uplink")`},
		{"ports", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, Match: Match{DstPorts: []string{"443"}}},
			"spec.match: unit requests matches every request of the processes that enforce it"},
		{"egress", RateLimitSpec{Rate: 10, Unit: UnitRequests, Scope: ScopeStatic, Match: Match{Direction: DirectionEgress}},
			"spec.match: unit requests matches every request"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.spec
			s.Default()
			errs := fieldErrors(t, s.Validate("spec"))
			if len(errs) != 1 || !strings.HasPrefix(errs[0].Error(), tt.want) {
				t.Errorf("Validate = %v, want only %s", errs, tt.want)
			}
		})
	}
}

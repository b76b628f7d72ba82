package agent

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// dashboard is deploy/monitoring's Grafana dashboard.
const dashboard = "../deploy/monitoring/grafana-dashboard.json"

// TestDashboardMetrics: every metric the Grafana dashboard's queries (its
// panels' and its variables') name is one the agent serves; a renamed or
// misspelled metric is a panel that silently shows "No data".
func TestDashboardMetrics(t *testing.T) {
	served := servedMetrics(t)
	data, err := os.ReadFile(dashboard)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels     []dashPanel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", dashboard, err)
	}
	type query struct{ where, expr string }
	var queries []query
	var walk func([]dashPanel)
	walk = func(ps []dashPanel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				queries = append(queries, query{fmt.Sprintf("panel %q, target %s", p.Title, tg.RefID), tg.Expr})
			}
			walk(p.Panels) // a collapsed row holds its panels
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			if err := json.Unmarshal(v.Query, &q.Query); err != nil {
				t.Fatalf("variable %s: query %s", v.Name, v.Query)
			}
		}
		// label_values(EXPR, LABEL): the label is no metric.
		expr, ok := strings.CutPrefix(q.Query, "label_values(")
		if ok {
			if i := strings.LastIndex(expr, ","); i >= 0 {
				expr = expr[:i]
			}
		}
		queries = append(queries, query{"variable " + v.Name, expr})
	}
	if len(queries) < 10 {
		t.Fatalf("%s: %d queries; want the dashboard's panels", dashboard, len(queries))
	}
	used := map[string]bool{}
	for _, q := range queries {
		names, err := metricNames(q.expr)
		if err != nil {
			t.Errorf("%s: %v\n%s", q.where, err, q.expr)
			continue
		}
		if len(names) == 0 {
			t.Errorf("%s: names no metric\n%s", q.where, q.expr)
		}
		for _, n := range names {
			base, ok := served.resolve(n)
			if !ok {
				t.Errorf("%s: %s is not a metric the agent serves\n%s", q.where, n, q.expr)
			}
			used[base] = true
		}
	}
	t.Logf("%d queries name %d of the %d metrics the agent serves", len(queries), len(used), len(served))
}

type dashPanel struct {
	Title   string `json:"title"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []dashPanel `json:"panels"`
}

// metricKind is what a served metric is, as far as a query's name for it
// goes: only a histogram's (or a summary's) series have suffixes.
type metricKind int

const (
	kindOther metricKind = iota
	kindHistogram
	kindSummary
)

// metricSet is the names of served metrics, with their kinds.
type metricSet map[string]metricKind

// resolve returns the metric a query's name refers to: the name itself, or
// a histogram's NAME for NAME_bucket, NAME_sum and NAME_count (a summary's
// for _sum and _count).
func (s metricSet) resolve(name string) (string, bool) {
	if _, ok := s[name]; ok {
		return name, true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suf)
		if !ok {
			continue
		}
		switch s[base] {
		case kindHistogram:
			return base, true
		case kindSummary:
			return base, suf != "_bucket"
		}
	}
	return name, false
}

// fqName reads a Desc's name: client_golang has no accessor, and its
// String is `Desc{fqName: "NAME", help: ...}`.
var fqName = regexp.MustCompile(`^Desc\{fqName: "([^"]+)"`)

// servedMetrics returns the metrics the agent serves: the descriptions of
// the collectors Run registers, and the metrics it makes from options
// (prometheus.CounterOpts{Name: ...} and the like) anywhere in the
// package's code. Run's collectors are listed here again; one added there
// and not here fails this test only when the dashboard uses its metrics.
func servedMetrics(t *testing.T) metricSet {
	t.Helper()
	s := metricSet{}
	ch := make(chan *prometheus.Desc)
	go func() {
		for _, c := range []prometheus.Collector{&collector{}, clusterCollector{}, &protectState{}, &health{}} {
			c.Describe(ch)
		}
		close(ch)
	}()
	for d := range ch {
		m := fqName.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("cannot read the name of %s", d)
		}
		s[m[1]] = kindOther // const metrics: the agent makes no histograms there
	}
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	opts := map[string]metricKind{"CounterOpts": kindOther, "GaugeOpts": kindOther,
		"HistogramOpts": kindHistogram, "SummaryOpts": kindSummary}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			lit, ok := n.(*ast.CompositeLit)
			if !ok {
				return true
			}
			sel, ok := lit.Type.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			kind, ok := opts[sel.Sel.Name]
			if x, isIdent := sel.X.(*ast.Ident); !ok || !isIdent || x.Name != "prometheus" {
				return true
			}
			for _, e := range lit.Elts {
				kv, ok := e.(*ast.KeyValueExpr)
				if !ok || fmt.Sprint(kv.Key) != "Name" {
					continue
				}
				bl, ok := kv.Value.(*ast.BasicLit)
				if !ok {
					t.Errorf("%s: a metric name that is not a string literal", fset.Position(kv.Pos()))
					continue
				}
				name, _ := strconv.Unquote(bl.Value)
				s[name] = kind
			}
			return true
		})
	}
	for _, want := range []string{"rlagent_limit_admitted_packets_total", "rlagent_ready", "rlagent_reconcile_errors_total"} {
		if _, ok := s[want]; !ok {
			t.Fatalf("the served metrics found lack %s: %v", want, slices.Sorted(func(yield func(string) bool) {
				for n := range s {
					if !yield(n) {
						return
					}
				}
			}))
		}
	}
	return s
}

// promqlKeywords are PromQL's words that are never a metric: the binary
// operators' keywords and the number literals (PromQL reads Inf and NaN in
// any case).
var promqlKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "bool": true, "offset": true,
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"inf": true, "nan": true,
}

// labelListKeywords are followed by a list of label names in parentheses.
var labelListKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// aggregations are PromQL's aggregation operators: `sum by (l) (x)` puts a
// keyword, not the parenthesis, after the name.
var aggregations = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
	"limitk": true, "limit_ratio": true,
}

// metricNames returns the metric names a PromQL expression (with Grafana's
// variables, $name, ${name} and [[name]]) selects, in order, each once. It
// is a tokenizer, not a parser: a name is an identifier that is not a
// keyword, not followed by "(" (a function) and not inside {...} (label
// matchers: a name there is a label, except __name__="..."), [...] (a range
// or a subquery's step) or the label list after by, without, on, ignoring,
// group_left and group_right; strings and comments are skipped. It fails on
// what it cannot read: an unterminated string or an unbalanced bracket.
func metricNames(expr string) ([]string, error) {
	var names []string
	add := func(n string) {
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	skipSpace := func(i int) int {
		for i < len(expr) && strings.IndexByte(" \t\r\n", expr[i]) >= 0 {
			i++
		}
		return i
	}
	// skipString returns the index after the string literal at i.
	skipString := func(i int) (int, error) {
		q := expr[i]
		for j := i + 1; j < len(expr); j++ {
			switch {
			case expr[j] == '\\' && q != '`':
				j++
			case expr[j] == q:
				return j + 1, nil
			}
		}
		return 0, fmt.Errorf("unterminated string at %d", i)
	}
	// closing returns the index after the bracket that closes the one at
	// i, skipping strings inside.
	closing := func(i int) (int, error) {
		open, shut := expr[i], map[byte]byte{'(': ')', '[': ']', '{': '}'}[expr[i]]
		depth := 0
		for j := i; j < len(expr); j++ {
			switch expr[j] {
			case '"', '\'', '`':
				k, err := skipString(j)
				if err != nil {
					return 0, err
				}
				j = k - 1
			case open:
				depth++
			case shut:
				if depth--; depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, fmt.Errorf("%q at %d is not closed", open, i)
	}
	// nameMatcher finds the metric a __name__ matcher names in {...}.
	nameMatcher := regexp.MustCompile(`(?:^|[{,])\s*__name__\s*=\s*"([^"\\]*)"`)
	depth := 0
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case strings.IndexByte(" \t\r\n", c) >= 0:
			i++
		case c == '#': // a comment, to the end of the line
			for i < len(expr) && expr[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			j, err := skipString(i)
			if err != nil {
				return nil, err
			}
			i = j
		case c == '$': // a Grafana variable: $name, ${name}
			i++
			if i < len(expr) && expr[i] == '{' {
				j, err := closing(i)
				if err != nil {
					return nil, err
				}
				i = j
			}
			for i < len(expr) && isIdent(expr[i]) {
				i++
			}
		case strings.HasPrefix(expr[i:], "[[") && !strings.HasPrefix(expr[i:], "[[["): // a Grafana variable, [[name]]
			j := strings.Index(expr[i:], "]]")
			if j < 0 {
				return nil, fmt.Errorf("%q at %d is not closed", "[[", i)
			}
			i += j + 2
		case c == '[' || c == '{':
			j, err := closing(i)
			if err != nil {
				return nil, err
			}
			if c == '{' {
				if m := nameMatcher.FindStringSubmatch(expr[i:j]); m != nil {
					add(m[1])
				}
			}
			i = j
		case c == ']' || c == '}':
			return nil, fmt.Errorf("%q at %d closes nothing", c, i)
		case c == '(':
			depth++
			i++
		case c == ')':
			if depth--; depth < 0 {
				return nil, fmt.Errorf("%q at %d closes nothing", c, i)
			}
			i++
		case c >= '0' && c <= '9' || c == '.':
			// A number or a duration: 1, 0.5, 1e3, 0x1f, 5m, 1h30m.
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word := expr[i:j]
			next := skipSpace(j)
			switch {
			case labelListKeywords[word] && next < len(expr) && expr[next] == '(':
				k, err := closing(next)
				if err != nil {
					return nil, err
				}
				j = k
			case promqlKeywords[strings.ToLower(word)]:
			case next < len(expr) && expr[next] == '(': // a function, or an aggregation
			case aggregations[word] && (strings.HasPrefix(expr[next:], "by") || strings.HasPrefix(expr[next:], "without")):
			default:
				add(word)
			}
			i = j
		default: // an operator: + - * / % ^ == != < > <= >= = ~ , @ :
			i++
		}
	}
	if depth != 0 {
		return nil, fmt.Errorf("%d parentheses not closed", depth)
	}
	return names, nil
}

// TestMetricNames: the tokenizer on expressions that trip a naive one.
func TestMetricNames(t *testing.T) {
	for _, tt := range []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		// An aggregation with its label list before the body, and a
		// function: by's labels and the function names are no metrics.
		{`sum by (limit, unit) (rate(rlagent_x_total[5m]))`, []string{"rlagent_x_total"}},
		// ... and after it.
		{`sum(rate(a_total{job="x"}[1m])) without (instance)`, []string{"a_total"}},
		// Label names and values in matchers, regexes with brackets and
		// braces, escaped quotes, Grafana variables.
		{`a{instance=~"$instance", le!~"[0-9]{2}\"}", path='/x{y}'}`, []string{"a"}},
		{`rate(b[$__rate_interval]) * on (instance) group_left (node) c{job="${job}"}`, []string{"b", "c"}},
		// Keywords: bool, offset with a duration, and, or, unless, and the
		// numbers Inf and NaN in any case.
		{`d > bool 0.5 and e offset 1h30m or f unless g == +Inf != NaN`, []string{"d", "e", "f", "g"}},
		// A subquery, @ with a function, a histogram.
		{`histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m:30s] @ end())))`, []string{"h_bucket"}},
		// A metric named in __name__, and the same metric twice.
		{`{__name__="i_total", job="j"} + i_total`, []string{"i_total"}},
		// Strings in function arguments are no names; colons are.
		{`label_replace(count_values("v", k:rate5m), "dst", "$1", "src", "(.*)")`, []string{"k:rate5m"}},
		// A comment, and a word that only starts like a keyword.
		{"order_total # by (x) not_a_metric\n/ bytes_total", []string{"order_total", "bytes_total"}},
		// An aggregation's name, used as a metric's, is one.
		{`sum + count`, []string{"sum", "count"}},
		// A grafana [[variable]].
		{`l{instance="[[node]]"} / m[[[interval]]]`, []string{"l", "m"}},
	} {
		got, err := metricNames(tt.expr)
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("metricNames(%q) = %q, %v; want %q", tt.expr, got, err, tt.want)
		}
	}
	for _, bad := range []string{`a{job="x}`, `rate(a[5m]`, `a)`, `a]`} {
		if got, err := metricNames(bad); err == nil {
			t.Errorf("metricNames(%q) = %q, want an error", bad, got)
		}
	}

	served := metricSet{"h_seconds": kindHistogram, "s_seconds": kindSummary, "c_total": kindOther, "g_count": kindOther}
	for name, want := range map[string]bool{
		"h_seconds_bucket": true, "h_seconds_sum": true, "h_seconds_count": true, "h_seconds": true,
		"s_seconds_sum": true, "s_seconds_bucket": false,
		"c_total": true, "c_total_count": false, "c": false, // a counter has no suffixed series; _total is its name
		"g_count": true, "g": false, // a gauge named ..._count is itself, not a histogram's
	} {
		if _, ok := served.resolve(name); ok != want {
			t.Errorf("resolve(%s) = %v, want %v", name, ok, want)
		}
	}
}

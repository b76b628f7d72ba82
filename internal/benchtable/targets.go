package main

import (
	"fmt"
	"io"
	"strings"
)

// A target is one of the data path's performance targets (issue 28), read
// from the medians of the table: a figure and the bound it must keep, or
// the range it must fall in.
type target struct {
	what  string
	bound float64
	// atMost: the figure must be <= bound; else >= bound.
	atMost bool
	// upTo, when not 0, makes the target a range: bound <= figure <= upTo.
	upTo float64
	// reported: a figure printed beside the targets, with no bound.
	reported bool
	// figure computes the figure from the table; false if a benchmark it
	// needs did not run.
	figure func(t *table) (float64, bool)
}

// cellOf is a figure read from one cell.
func cellOf(name, unit string) func(*table) (float64, bool) {
	return func(t *table) (float64, bool) { return t.cell(name, unit) }
}

// targets are the targets of issue 28 and of the limiter library (issue
// 25); docs/benchmarks.md explains each. x-floor, the target of issue 12,
// is a column only: the floor is within the noise of the parse.
var targets = []target{
	{what: "limits=1 x-peer-cls (classified GCRA peer, 1 CPU)", bound: 1.0, atMost: true, figure: cellOf("BenchmarkXDP/limits=1", "x-peer-cls")},
	{what: "overload=1 x-peer-cls (1 CPU)", bound: 1.0, atMost: true, figure: cellOf("BenchmarkXDP/overload=1", "x-peer-cls")},
	{what: "cpus=2-overload x-peer-cls (2 CPUs)", bound: 1.0, atMost: true, figure: cellOf("BenchmarkXDP/cpus=2-overload", "x-peer-cls")},
	{what: "cpus=2-overload x-1cpu", bound: 1.05, atMost: true, figure: cellOf("BenchmarkXDP/cpus=2-overload", "x-1cpu")},
	{what: "cpus=2 x-peer (fixed-bucket GCRA, 2 CPUs)", bound: 0.25, atMost: true, figure: cellOf("BenchmarkXDP/cpus=2", "x-peer")},
	{what: "limits=1 x-peer (fixed-bucket GCRA, 1 CPU)", bound: 1.25, atMost: true, figure: cellOf("BenchmarkXDP/limits=1", "x-peer")},
	{what: "overload=1 x-peer (fixed-bucket GCRA, 1 CPU)", reported: true, figure: cellOf("BenchmarkXDP/overload=1", "x-peer")},
	{what: "keys=1k x-peer-keyed (keyed GCRA peer, 1 CPU)", bound: 1.0, atMost: true, figure: cellOf("BenchmarkXDP/keys=1k", "x-peer-keyed")},
	{what: "keys=1M x-dram", bound: 1.5, atMost: true, figure: cellOf("BenchmarkXDP/keys=1M", "x-dram")},
	{what: "each extra matching limit, (limits=3 - limits=1) / 2, over the classified peer's pass path (ns-peer-cls of limits=1)",
		bound: 0.75, atMost: true, figure: func(t *table) (float64, bool) {
			three, ok3 := t.cell("BenchmarkXDP/limits=3", "ns/packet")
			one, ok1 := t.cell("BenchmarkXDP/limits=1", "ns/packet")
			peer, okP := t.cell("BenchmarkXDP/limits=1", "ns-peer-cls")
			return (three - one) / 2 / peer, ok3 && ok1 && okP && peer > 0
		}},
	{what: "x/time/rate Allow / (limits=1 - baseline)", bound: 8, figure: func(t *table) (float64, bool) {
		allow, okA := t.cell("BenchmarkRateAllow", "ns/packet")
		one, ok1 := t.cell("BenchmarkXDP/limits=1", "ns/packet")
		base, okB := t.cell("BenchmarkBaseline", "ns/packet")
		return allow / (one - base), okA && ok1 && okB && one > base
	}},
	// The live path: a drop limit's frame rate against the bare drop, and
	// each case's added ns against test_run's on the same programs.
	{what: "live overload=1 x-bare (frame rate over a bare XDP_DROP's)", bound: 0.9, figure: cellOf("BenchmarkLive/overload=1", "x-bare")},
	{what: "live limits=1 x-testrun (ns added on the live path over test_run's)", bound: 0.75, upTo: 1.25, figure: cellOf("BenchmarkLive/limits=1", "x-testrun")},
	{what: "live overload=1 x-testrun", bound: 0.75, upTo: 1.25, figure: cellOf("BenchmarkLive/overload=1", "x-testrun")},
	{what: "live keys=1k x-testrun", bound: 0.75, upTo: 1.25, figure: cellOf("BenchmarkLive/keys=1k", "x-testrun")},
	{what: "live limits=3 x-testrun", bound: 0.75, upTo: 1.25, figure: cellOf("BenchmarkLive/limits=3", "x-testrun")},
	// The limiter library (issue 25): ratios to references timed in the same run.
	{what: "limiter Allow, 1 goroutine, x-rate (x/time/rate Allow)", bound: 1.0, atMost: true, figure: cellOf("BenchmarkAllow/goroutines=1", "x-rate")},
	{what: "limiter Allow, GOMAXPROCS goroutines, x-rate", bound: 0.25, atMost: true, figure: cellOf("BenchmarkAllow/goroutines=gomaxprocs", "x-rate")},
	{what: "limiter keyed, 1M keys, x-map (a Go map lookup)", bound: 2.0, atMost: true, figure: cellOf("BenchmarkAllowKeyed", "x-map")},
}

// writeTargets prints the targets whose benchmarks ran, each with its
// figure, its bound and whether it holds. It prints nothing if none ran.
func (t *table) writeTargets(w io.Writer) error {
	var b strings.Builder
	for _, tg := range targets {
		v, ok := tg.figure(t)
		if !ok {
			continue
		}
		if b.Len() == 0 {
			b.WriteString("\n| target | measured | bound | |\n|---|---:|---:|---|\n")
		}
		bound, met := ">= "+formatValue(tg.bound), v >= tg.bound
		switch {
		case tg.reported:
			bound = "-"
		case tg.upTo != 0:
			bound, met = formatValue(tg.bound)+" to "+formatValue(tg.upTo), v >= tg.bound && v <= tg.upTo
		case tg.atMost:
			bound, met = "<= "+formatValue(tg.bound), v <= tg.bound
		}
		verdict := "met"
		switch {
		case tg.reported:
			verdict = "reported"
		case !met:
			verdict = "**missed**"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", tg.what, formatValue(v), bound, verdict)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

package main

import (
	"fmt"
	"io"
	"strings"
)

// A target is one of the data path's performance targets (issue 12), read
// from the medians of the table: a figure and the bound it must keep.
type target struct {
	what  string
	bound float64
	// atMost: the figure must be <= bound; else >= bound.
	atMost bool
	// figure computes the figure from the table; false if a benchmark it
	// needs did not run.
	figure func(t *table) (float64, bool)
}

// cellOf is a figure read from one cell.
func cellOf(name, unit string) func(*table) (float64, bool) {
	return func(t *table) (float64, bool) { return t.cell(name, unit) }
}

// targets are the issue-12 targets; docs/benchmarks.md explains each.
var targets = []target{
	{what: "limits=1 x-floor", bound: 1.6, atMost: true, figure: cellOf("BenchmarkXDP/limits=1", "x-floor")},
	{what: "overload=1 x-floor", bound: 1.6, atMost: true, figure: cellOf("BenchmarkXDP/overload=1", "x-floor")},
	{what: "limits=1 x-peer (GCRA, 1 CPU)", bound: 0.6, atMost: true, figure: cellOf("BenchmarkXDP/limits=1", "x-peer")},
	{what: "overload=1 x-peer (GCRA, 1 CPU)", bound: 0.6, atMost: true, figure: cellOf("BenchmarkXDP/overload=1", "x-peer")},
	{what: "cpus=2 x-peer (GCRA, 2 CPUs)", bound: 0.25, atMost: true, figure: cellOf("BenchmarkXDP/cpus=2", "x-peer")},
	{what: "cpus=2-overload x-peer (GCRA, 2 CPUs)", bound: 0.25, atMost: true, figure: cellOf("BenchmarkXDP/cpus=2-overload", "x-peer")},
	{what: "limits=1 x-peer-lock (1 CPU)", bound: 0.4, atMost: true, figure: cellOf("BenchmarkXDP/limits=1", "x-peer-lock")},
	{what: "overload=1 x-peer-lock (1 CPU)", bound: 0.4, atMost: true, figure: cellOf("BenchmarkXDP/overload=1", "x-peer-lock")},
	{what: "cpus=2 x-peer-lock (2 CPUs)", bound: 0.2, atMost: true, figure: cellOf("BenchmarkXDP/cpus=2", "x-peer-lock")},
	{what: "cpus=2-overload x-peer-lock (2 CPUs)", bound: 0.2, atMost: true, figure: cellOf("BenchmarkXDP/cpus=2-overload", "x-peer-lock")},
	{what: "each extra matching limit, in floors: (x-floor limits=3 - limits=1) / 2", bound: 1.0, atMost: true,
		figure: func(t *table) (float64, bool) {
			three, ok3 := t.cell("BenchmarkXDP/limits=3", "x-floor")
			one, ok1 := t.cell("BenchmarkXDP/limits=1", "x-floor")
			return (three - one) / 2, ok3 && ok1
		}},
	{what: "keys=1k x-floor", bound: 4, atMost: true, figure: cellOf("BenchmarkXDP/keys=1k", "x-floor")},
	{what: "keys=1M x-dram", bound: 2, atMost: true, figure: cellOf("BenchmarkXDP/keys=1M", "x-dram")},
	{what: "x/time/rate Allow over limits=1 (ns/packet)", bound: 8, figure: ratioOf("BenchmarkRateAllow", "BenchmarkXDP/limits=1")},
	{what: "x/time/rate Allow over keys=1k (ns/packet)", bound: 4, figure: ratioOf("BenchmarkRateAllow", "BenchmarkXDP/keys=1k")},
	// The limiter library (issue 25): ratios to references timed in the same run.
	{what: "limiter Allow, 1 goroutine, x-rate (x/time/rate Allow)", bound: 1.0, atMost: true, figure: cellOf("BenchmarkAllow/goroutines=1", "x-rate")},
	{what: "limiter Allow, GOMAXPROCS goroutines, x-rate", bound: 0.25, atMost: true, figure: cellOf("BenchmarkAllow/goroutines=gomaxprocs", "x-rate")},
	{what: "limiter keyed, 1M keys, x-map (a Go map lookup)", bound: 2.0, atMost: true, figure: cellOf("BenchmarkAllowKeyed", "x-map")},
}

// ratioOf is a's ns/packet over b's.
func ratioOf(a, b string) func(*table) (float64, bool) {
	return func(t *table) (float64, bool) {
		x, okA := t.cell(a, "ns/packet")
		y, okB := t.cell(b, "ns/packet")
		return x / y, okA && okB && y > 0
	}
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
		op, met := ">=", v >= tg.bound
		if tg.atMost {
			op, met = "<=", v <= tg.bound
		}
		verdict := "met"
		if !met {
			verdict = "**missed**"
		}
		fmt.Fprintf(&b, "| %s | %s | %s %s | %s |\n", tg.what, formatValue(v), op, formatValue(tg.bound), verdict)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// Command benchtable turns `go test -bench` output into the Markdown summary
// table kept in docs/benchmarks.md.
//
// It reads the raw output on stdin (as written by `make bench` into bench.out)
// and prints one row per benchmark, named without the -GOMAXPROCS suffix, with
// ns/op, ns/packet, Mpps and every custom metric whose unit starts with "x-"
// (the ratios the benchmarks report, such as x-baseline and x-1cpu) or "ns-"
// (costs beyond a reference, such as ns-added and ns-peer-cls). Columns appear
// in the order their units are first seen; a cell is blank when a benchmark
// does not report that unit. When a benchmark ran several times (-count > 1)
// each cell is the median of its runs. Other units (B/op, allocs/op, MB/s) are
// left out.
//
// Usage:
//
//	go test -run '^$' -bench . -count 3 ./bpf/ > bench.out
//	go run ./internal/benchtable < bench.out
//
// After the table it prints the data path's performance targets (targets.go)
// whose benchmarks ran: each figure, its bound, and met or missed.
//
// It exits non-zero when the input holds no benchmark result line, so that a
// run where every benchmark skipped (no root) does not print an empty table.
//
// The suffix is stripped blindly: runs with several -cpu values are merged.
package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}

func run(in io.Reader, out io.Writer) error {
	t, err := parse(in)
	if err != nil {
		return err
	}
	if err := t.writeMarkdown(out); err != nil {
		return err
	}
	return t.writeTargets(out)
}

// errNoBenchmarks is returned by parse when the input has no result line.
var errNoBenchmarks = errors.New("no benchmark result lines on stdin (did every benchmark skip or fail?)")

// table holds the parsed results in first-seen order.
type table struct {
	names   []string                        // benchmark names, suffix stripped, first-seen order
	units   []string                        // reported units, first-seen order
	samples map[string]map[string][]float64 // name -> unit -> one value per run
}

// keepUnit reports whether a metric unit gets a column.
func keepUnit(unit string) bool {
	return unit == "ns/op" || unit == "ns/packet" || unit == "Mpps" || strings.HasPrefix(unit, "x-") ||
		strings.HasPrefix(unit, "ns-")
}

// procsSuffix is the "-N" the testing package appends to a benchmark name when
// GOMAXPROCS is not 1.
var procsSuffix = regexp.MustCompile(`-[0-9]+$`)

// parse reads `go test -bench` output. A result line is
//
//	BenchmarkName-N <iterations> <value> <unit> [<value> <unit> ...]
//
// with fields separated by blanks; everything else (goos:, PASS, log output,
// the bare name lines -v prints) is ignored.
func parse(r io.Reader) (*table, error) {
	t := &table{samples: map[string]map[string][]float64{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 || len(fields)%2 != 0 || !strings.HasPrefix(fields[0], "Benchmark") {
			continue
		}
		if _, err := strconv.ParseUint(fields[1], 10, 64); err != nil {
			continue
		}
		metrics := map[string]float64{}
		var order []string
		ok := true
		for i := 2; i < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				ok = false
				break
			}
			unit := fields[i+1]
			if keepUnit(unit) {
				metrics[unit] = v
				order = append(order, unit)
			}
		}
		if !ok {
			continue
		}
		name := procsSuffix.ReplaceAllString(fields[0], "")
		byUnit, seen := t.samples[name]
		if !seen {
			byUnit = map[string][]float64{}
			t.samples[name] = byUnit
			t.names = append(t.names, name)
		}
		for _, unit := range order {
			if !slices.Contains(t.units, unit) {
				t.units = append(t.units, unit)
			}
			byUnit[unit] = append(byUnit[unit], metrics[unit])
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read benchmark output: %w", err)
	}
	if len(t.names) == 0 {
		return nil, errNoBenchmarks
	}
	return t, nil
}

// median returns the median of vs (the mean of the two middle values for an
// even count). vs must not be empty.
func median(vs []float64) float64 {
	s := slices.Clone(vs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// cell returns the median for name and unit, and false if there is none.
func (t *table) cell(name, unit string) (float64, bool) {
	vs := t.samples[name][unit]
	if len(vs) == 0 {
		return 0, false
	}
	return median(vs), true
}

// formatValue prints four significant digits, without an exponent for large values.
func formatValue(v float64) string {
	if v >= 1e4 || v <= -1e4 {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'g', 4, 64)
}

func (t *table) writeMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("| case |")
	for _, u := range t.units {
		b.WriteString(" " + u + " |")
	}
	b.WriteString("\n|---|")
	for range t.units {
		b.WriteString("---:|")
	}
	b.WriteString("\n")
	for _, name := range t.names {
		b.WriteString("| " + name + " |")
		for _, u := range t.units {
			if v, ok := t.cell(name, u); ok {
				b.WriteString(" " + formatValue(v) + " |")
			} else {
				b.WriteString(" |")
			}
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

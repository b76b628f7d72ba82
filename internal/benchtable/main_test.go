package main

import (
	"errors"
	"strings"
	"testing"
)

// sample is `go test -bench . -count 3 -benchmem` output in the shape bpf/
// prints, with the noise a real run has: headers, a bare name line followed by
// log output, and the PASS/ok trailer.
const sample = `goos: linux
goarch: amd64
pkg: github.com/rlagent/rlagent/bpf
cpu: AMD EPYC 7B13
BenchmarkBaseline-2               	 1000000	        10.0 ns/op	        10.0 ns/packet
BenchmarkBaseline-2               	 1000000	        12.0 ns/op	        12.0 ns/packet
BenchmarkBaseline-2               	 1000000	        11.0 ns/op	        11.0 ns/packet
BenchmarkXDP/limits=1
    bench_test.go:42: limit 0: share 1000 pkt/s
BenchmarkXDP/limits=1-2           	 1000000	        12.3 ns/op	        13.1 ns/packet	         1.12 x-baseline
BenchmarkXDP/limits=1-2           	 1000000	        12.9 ns/op	        13.9 ns/packet	         1.30 x-baseline
BenchmarkXDP/limits=1-2           	 1000000	        12.1 ns/op	        12.8 ns/packet	         1.10 x-baseline
BenchmarkXDP/cpus=2-2             	  500000	        30.0 ns/op	        15.0 ns/packet	         1.50 x-baseline	         1.05 x-1cpu
BenchmarkXDP/cpus=2-2             	  500000	        31.0 ns/op	        15.5 ns/packet	         1.55 x-baseline	         0.96 x-1cpu
BenchmarkXDP/cpus=2-2             	  500000	        29.0 ns/op	        14.5 ns/packet	         1.45 x-baseline	         1.12 x-1cpu
BenchmarkRateAllow-2              	20000000	        60.5 ns/op	       0 B/op	       0 allocs/op
BenchmarkRateAllow-2              	20000000	        58.5 ns/op	       0 B/op	       0 allocs/op
BenchmarkRateAllow-2              	20000000	        59.5 ns/op	       0 B/op	       0 allocs/op
PASS
ok  	github.com/rlagent/rlagent/bpf	42.000s
`

func TestParse(t *testing.T) {
	tab, err := parse(strings.NewReader(sample))
	if err != nil {
		t.Fatalf("parse: %v", err)
	}

	wantNames := []string{"BenchmarkBaseline", "BenchmarkXDP/limits=1", "BenchmarkXDP/cpus=2", "BenchmarkRateAllow"}
	if strings.Join(tab.names, ",") != strings.Join(wantNames, ",") {
		t.Errorf("names = %q, want %q", tab.names, wantNames)
	}
	wantUnits := []string{"ns/op", "ns/packet", "x-baseline", "x-1cpu"}
	if strings.Join(tab.units, ",") != strings.Join(wantUnits, ",") {
		t.Errorf("units = %q, want %q (first-seen order, B/op and allocs/op dropped)", tab.units, wantUnits)
	}

	tests := []struct {
		name, unit string
		runs       int     // samples kept (the -count)
		want       float64 // median of the runs
		absent     bool
	}{
		{name: "BenchmarkBaseline", unit: "ns/packet", runs: 3, want: 11.0},
		{name: "BenchmarkXDP/limits=1", unit: "ns/op", runs: 3, want: 12.3},
		{name: "BenchmarkXDP/limits=1", unit: "ns/packet", runs: 3, want: 13.1},
		{name: "BenchmarkXDP/limits=1", unit: "x-baseline", runs: 3, want: 1.12},
		{name: "BenchmarkXDP/cpus=2", unit: "x-1cpu", runs: 3, want: 1.05},
		{name: "BenchmarkXDP/cpus=2", unit: "x-baseline", runs: 3, want: 1.50},
		{name: "BenchmarkRateAllow", unit: "ns/op", runs: 3, want: 59.5},
		{name: "BenchmarkRateAllow", unit: "ns/packet", absent: true},
		{name: "BenchmarkXDP/limits=1", unit: "x-1cpu", absent: true},
	}
	for _, tt := range tests {
		t.Run(tt.name+"/"+tt.unit, func(t *testing.T) {
			if got := len(tab.samples[tt.name][tt.unit]); got != tt.runs {
				t.Errorf("runs = %d, want %d", got, tt.runs)
			}
			got, ok := tab.cell(tt.name, tt.unit)
			if tt.absent {
				if ok {
					t.Errorf("cell = %v, want absent", got)
				}
				return
			}
			if !ok || got != tt.want {
				t.Errorf("median = %v (present %v), want %v", got, ok, tt.want)
			}
		})
	}
}

func TestMedian(t *testing.T) {
	tests := []struct {
		in   []float64
		want float64
	}{
		{[]float64{7}, 7},
		{[]float64{3, 1, 2}, 2},
		{[]float64{1.30, 1.12, 1.10}, 1.12},
		{[]float64{4, 1, 3, 2}, 2.5},
	}
	for _, tt := range tests {
		if got := median(tt.in); got != tt.want {
			t.Errorf("median(%v) = %v, want %v", tt.in, got, tt.want)
		}
	}
}

func TestRunMarkdown(t *testing.T) {
	var out strings.Builder
	if err := run(strings.NewReader(sample), &out); err != nil {
		t.Fatalf("run: %v", err)
	}
	want := `| case | ns/op | ns/packet | x-baseline | x-1cpu |
|---|---:|---:|---:|---:|
| BenchmarkBaseline | 11 | 11 | | |
| BenchmarkXDP/limits=1 | 12.3 | 13.1 | 1.12 | |
| BenchmarkXDP/cpus=2 | 30 | 15 | 1.5 | 1.05 |
| BenchmarkRateAllow | 59.5 | | | |
`
	if out.String() != want {
		t.Errorf("output:\n%s\nwant:\n%s", out.String(), want)
	}
}

func TestNoBenchmarks(t *testing.T) {
	in := "goos: linux\n--- SKIP: BenchmarkXDP\n    testenv.go:20: needs root\nPASS\nok  \tgithub.com/rlagent/rlagent/bpf\t0.01s\n"
	err := run(strings.NewReader(in), &strings.Builder{})
	if !errors.Is(err, errNoBenchmarks) {
		t.Fatalf("run = %v, want %v", err, errNoBenchmarks)
	}
}

// TestTargets: the targets read the medians of the cells they name, derive
// the extra-limit cost and the ratio to x/time/rate, check ranges, mark
// what misses, print reported figures without a bound, and leave out what
// did not run.
func TestTargets(t *testing.T) {
	const out = `BenchmarkBaseline-2       	1000	8.0 ns/op	8.0 ns/packet
BenchmarkXDP/limits=1-2 	1000	20.0 ns/op	18.0 ns/packet	0.9 x-peer-cls	12.0 ns-peer-cls	1.5 x-peer
BenchmarkXDP/limits=1-2 	1000	20.0 ns/op	18.0 ns/packet	1.1 x-peer-cls	10.0 ns-peer-cls	1.1 x-peer
BenchmarkXDP/limits=1-2 	1000	20.0 ns/op	18.0 ns/packet	0.8 x-peer-cls	10.0 ns-peer-cls	1.2 x-peer
BenchmarkXDP/overload=1-2 	1000	20.0 ns/op	18.0 ns/packet	3.0 x-peer
BenchmarkXDP/limits=3-2 	1000	20.0 ns/op	30.0 ns/packet
BenchmarkRateAllow-2    	1000	90.0 ns/op	90.0 ns/packet
BenchmarkLive/limits=1-2 	1	1.0 ns/op	1.3 x-testrun
BenchmarkLive/overload=1-2 	1	1.0 ns/op	0.92 x-bare	0.8 x-testrun
`
	tab, err := parse(strings.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if err := tab.writeTargets(&b); err != nil {
		t.Fatal(err)
	}
	got := b.String()
	for _, want := range []string{
		"| limits=1 x-peer-cls (classified GCRA peer, 1 CPU) | 0.9 | <= 1 | met |",
		"| limits=1 x-peer (fixed-bucket GCRA, 1 CPU) | 1.2 | <= 1.25 | met |",
		"| overload=1 x-peer (fixed-bucket GCRA, 1 CPU) | 3 | - | reported |",
		// (30 - 18) / 2 / 10
		"| each extra matching limit, (limits=3 - limits=1) / 2, over the classified peer's pass path (ns-peer-cls of limits=1) | 0.6 | <= 0.75 | met |",
		// 90 / (18 - 8)
		"| x/time/rate Allow / (limits=1 - baseline) | 9 | >= 8 | met |",
		"| live overload=1 x-bare (frame rate over a bare XDP_DROP's) | 0.92 | >= 0.9 | met |",
		"| live limits=1 x-testrun (ns added on the live path over test_run's) | 1.3 | 0.75 to 1.25 | **missed** |",
		"| live overload=1 x-testrun | 0.8 | 0.75 to 1.25 | met |",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("targets lack %q:\n%s", want, got)
		}
	}
	for _, absent := range []string{"keys=1M", "keys=1k", "cpus=2"} {
		if strings.Contains(got, absent) {
			t.Errorf("targets show %s, which did not run:\n%s", absent, got)
		}
	}
}

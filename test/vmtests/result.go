package vmtests

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// The VM's /init reports on the serial console in lines that start with
// marker, followed by a kind and key=value fields:
//
//	@@vmtest boot kernel=6.1.0-40-cloud-amd64 uptime=6.02
//	@@vmtest suite name=bpf.test status=0 seconds=12.31
//	@@vmtest done status=0
//
// The runner trusts only these lines: no done line means the VM did not
// finish (a kernel panic, a hung suite, a timeout), and that is a failure.
const marker = "@@vmtest "

// BootLine is the first line /init prints: the running kernel and how long
// it took to get to /init.
func BootLine(kernel string, uptime time.Duration) string {
	return fmt.Sprintf("%sboot kernel=%s uptime=%.2f", marker, kernel, uptime.Seconds())
}

// SuiteLine reports one suite's exit status (128+signal if a signal ended it).
func SuiteLine(name string, status int, d time.Duration) string {
	return fmt.Sprintf("%ssuite name=%s status=%d seconds=%.2f", marker, name, status, d.Seconds())
}

// DoneLine is the last line: 0 if every suite passed.
func DoneLine(status int) string {
	return fmt.Sprintf("%sdone status=%d", marker, status)
}

// SuiteResult is one suite's outcome as reported by /init.
type SuiteResult struct {
	Name     string
	Status   int
	Duration time.Duration
}

// Report is what one VM's console said, gathered line by line with Parse.
type Report struct {
	Kernel string        // uname -r in the VM
	Boot   time.Duration // uptime when /init started
	Suites []SuiteResult
	Done   bool // the done line was seen
	Status int  // its status
}

// Passed reports whether the VM finished and every suite passed.
func (r *Report) Passed() bool {
	if !r.Done || r.Status != 0 {
		return false
	}
	for _, s := range r.Suites {
		if s.Status != 0 {
			return false
		}
	}
	return true
}

// Parse records line if it is a report line and says whether it was one.
// The marker may follow other output on the same line (a kernel message
// printed in the middle of a line, a carriage return). A malformed report
// line is an error.
func (r *Report) Parse(line string) (bool, error) {
	i := strings.Index(line, marker)
	if i < 0 {
		return false, nil
	}
	fields := strings.Fields(line[i+len(marker):])
	if len(fields) == 0 {
		return true, fmt.Errorf("report line %q: no kind", line)
	}
	kv := make(map[string]string, len(fields)-1)
	for _, f := range fields[1:] {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			return true, fmt.Errorf("report line %q: field %q is not key=value", line, f)
		}
		kv[k] = v
	}
	need := func(keys ...string) error {
		for _, k := range keys {
			if _, ok := kv[k]; !ok {
				return fmt.Errorf("report line %q: no %s=", line, k)
			}
		}
		return nil
	}
	seconds := func(k string) (time.Duration, error) {
		f, err := strconv.ParseFloat(kv[k], 64)
		if err != nil || f < 0 {
			return 0, fmt.Errorf("report line %q: %s=%q is not a number of seconds", line, k, kv[k])
		}
		return time.Duration(f * float64(time.Second)), nil
	}
	status := func() (int, error) {
		n, err := strconv.Atoi(kv["status"])
		if err != nil {
			return 0, fmt.Errorf("report line %q: status=%q is not an integer", line, kv["status"])
		}
		return n, nil
	}
	switch fields[0] {
	case "boot":
		if err := need("kernel", "uptime"); err != nil {
			return true, err
		}
		up, err := seconds("uptime")
		if err != nil {
			return true, err
		}
		r.Kernel, r.Boot = kv["kernel"], up
	case "suite":
		if err := need("name", "status", "seconds"); err != nil {
			return true, err
		}
		st, err := status()
		if err != nil {
			return true, err
		}
		d, err := seconds("seconds")
		if err != nil {
			return true, err
		}
		r.Suites = append(r.Suites, SuiteResult{Name: kv["name"], Status: st, Duration: d})
	case "done":
		if err := need("status"); err != nil {
			return true, err
		}
		st, err := status()
		if err != nil {
			return true, err
		}
		r.Done, r.Status = true, st
	default:
		return true, fmt.Errorf("report line %q: unknown kind %q", line, fields[0])
	}
	return true, nil
}

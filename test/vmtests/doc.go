// Package vmtests runs rlagent's privileged test suites on other kernels
// than the host's, each in a qemu VM in software emulation (TCG).
//
// The route is an initramfs around static binaries: a cpio archive
// (CPIOWriter) holding a static Go /init (cmd/vminit), the suites' test
// binaries (CGO_ENABLED=0 go test -c), the rlagent binary, the kernel
// modules the suites need (veth) and a manifest saying what to run.
// /init mounts proc, sysfs, devtmpfs, bpffs, debugfs, tracefs and tmpfs,
// loads the modules, runs the suites and reports on the serial console in
// lines that Report parses; then it powers the VM off. A suite whose
// tests failed by name (at most MaxRerun of them) has those tests run
// again, up to Reruns times, and the last run's status is the suite's: a
// guest under emulation is now and then starved by its host for long
// enough to miss a rate bound, and the summary names every test that
// needed another run. cmd/vmtest is the
// runner; `make vmtest` builds the binaries and calls it.
//
// Kernels come from Debian's linux-image-*-unsigned packages (Fetcher):
// the newest package of a series, found with apt-cache in a private apt
// state per Debian release (the host's apt configuration is not used), is
// downloaded with apt-get download and extracted with dpkg-deb -x into the
// cache, where it stays. qemu is installed with apt-get when missing.
//
// Every VM runs under a timeout and is killed by PID when it passes. KVM is
// never used unless asked for with RLAGENT_VM_ACCEL (see AccelEnv).
package vmtests

package vmtests

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// ModuleFiles returns the files of the named modules and of the modules
// they depend on, in the order to load them (dependencies first). A module
// built into the kernel (modules.builtin) needs no file and is left out.
//
// A Debian package has no modules.dep (depmod writes it when the package
// is installed), so the dependencies are read from each module's .modinfo
// section ("depends=a,b"), decompressing .ko.xz and .ko.zst with the xz
// and zstd commands.
func (k *Kernel) ModuleFiles(names []string) ([]string, error) {
	index := map[string]string{}
	err := filepath.WalkDir(k.Modules, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.Contains(d.Name(), ".ko") {
			index[ModuleName(path)] = path
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(k.Modules, "modules.builtin")); err == nil {
		for _, line := range strings.Fields(string(b)) {
			builtin[ModuleName(line)] = true
		}
	}
	files, err := ModuleLoadOrder(names, index, builtin, moduleDepends)
	if err != nil {
		return nil, fmt.Errorf("kernel %s: %w", k.Release, err)
	}
	return files, nil
}

// ModuleLoadOrder resolves module names to files through index (module
// name to file), following depends (a file's dependencies, by name),
// and returns the files with each after those it depends on. Built-in
// modules are skipped.
func ModuleLoadOrder(names []string, index map[string]string, builtin map[string]bool, depends func(file string) ([]string, error)) ([]string, error) {
	var order []string
	seen := map[string]bool{}
	var visit func(name, from string) error
	visit = func(name, from string) error {
		name = strings.ReplaceAll(name, "-", "_")
		if seen[name] || builtin[name] {
			return nil
		}
		seen[name] = true
		file, ok := index[name]
		if !ok {
			if from != "" {
				return fmt.Errorf("module %s (needed by %s): no file and not built in", name, from)
			}
			return fmt.Errorf("module %s: no file and not built in", name)
		}
		deps, err := depends(file)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d, name); err != nil {
				return err
			}
		}
		order = append(order, file)
		return nil
	}
	for _, n := range names {
		if err := visit(n, ""); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// ModuleName is the module name of a module file's path: the base name
// without .ko and a compression suffix, with '-' read as '_' as the kernel does.
func ModuleName(path string) string {
	base := filepath.Base(path)
	if i := strings.Index(base, ".ko"); i >= 0 {
		base = base[:i]
	}
	return strings.ReplaceAll(base, "-", "_")
}

// moduleDepends reads the depends= field of a module file's .modinfo.
func moduleDepends(file string) ([]string, error) {
	b, err := readModule(file)
	if err != nil {
		return nil, err
	}
	f, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("%s: no .modinfo section", file)
	}
	info, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("%s: .modinfo: %w", file, err)
	}
	return ModinfoDepends(info), nil
}

// ModinfoDepends returns the module names in the depends= entry of a
// .modinfo section (NUL-separated key=value strings).
func ModinfoDepends(modinfo []byte) []string {
	for _, kv := range strings.Split(string(modinfo), "\x00") {
		if v, ok := strings.CutPrefix(kv, "depends="); ok {
			var deps []string
			for _, d := range strings.Split(v, ",") {
				if d != "" {
					deps = append(deps, d)
				}
			}
			return deps
		}
	}
	return nil
}

// readModule returns a module file's ELF bytes.
func readModule(file string) ([]byte, error) {
	var tool, pkg string
	switch {
	case strings.HasSuffix(file, ".ko"):
		return os.ReadFile(file)
	case strings.HasSuffix(file, ".ko.gz"):
		f, err := os.Open(file)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		z, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		return io.ReadAll(z)
	case strings.HasSuffix(file, ".ko.xz"):
		tool, pkg = "xz", "xz-utils"
	case strings.HasSuffix(file, ".ko.zst"):
		tool, pkg = "zstd", "zstd"
	default:
		return nil, fmt.Errorf("%s: not a module file (.ko, .ko.gz, .ko.xz, .ko.zst)", file)
	}
	if _, err := exec.LookPath(tool); err != nil {
		return nil, fmt.Errorf("%s: reading its dependencies needs %s: install the package %s", file, tool, pkg)
	}
	out, err := exec.Command(tool, "-dc", file).Output()
	if err != nil {
		return nil, fmt.Errorf("%s -dc %s: %w%s", tool, file, err, stderrOf(err))
	}
	return out, nil
}

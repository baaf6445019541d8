package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// versionLine is what jetbox version and jetbox --version print.
func versionLine() string {
	ver, revision := buildVersion()
	return fmt.Sprintf("jetbox %s (commit %s, %s)", ver, revision, runtime.Version())
}

// buildVersion is the version and VCS revision jetbox_build_info reports:
// the ones set at link time (-X main.version, -X main.commit), else what
// the Go toolchain recorded (the module version of a `go install`, the
// vcs.revision of a build in a git checkout), else dev and unknown.
func buildVersion() (ver, revision string) {
	ver, revision = version, commit
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return ver, fallback(revision)
	}
	if ver == "dev" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		ver = bi.Main.Version
	}
	if revision == "none" {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				revision = s.Value
			}
		}
	}
	return ver, fallback(revision)
}

func fallback(revision string) string {
	if revision == "" || revision == "none" {
		return "unknown"
	}
	return revision
}

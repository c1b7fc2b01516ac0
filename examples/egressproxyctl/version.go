package main

import (
	"runtime/debug"

	"github.com/spf13/cobra"
)

// versionInfo is what version prints: the module version and the VCS
// revision the binary was built from, as the Go toolchain recorded them.
type versionInfo struct {
	Version   string `json:"version"`
	Revision  string `json:"revision,omitempty"`
	Time      string `json:"time,omitempty"`
	Modified  bool   `json:"modified,omitempty"`
	GoVersion string `json:"goVersion"`
}

func newVersionCommand(c *cli) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "The program's version and the revision it was built from",
		Long: `Version prints the module version of the program ("(devel)" when it was built
inside its own source tree) and the VCS revision and time the Go toolchain
recorded at build time ("unknown" when the build recorded none).`,
		Example: `  egressproxyctl version
  egressproxyctl version -o json`,
		Args: args(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := c.version()
			revision, at := v.Revision, v.Time
			if revision == "" {
				revision = "unknown"
			}
			if v.Modified {
				revision += " (modified)"
			}
			if at == "" {
				at = "unknown"
			}
			return c.print(listing{
				doc:    v,
				header: []string{"VERSION", "REVISION", "TIME", "GO"},
				rows:   [][]string{{v.Version, revision, at, v.GoVersion}},
				names:  []string{v.Version},
			})
		},
	}
}

func (c *cli) version() versionInfo {
	read := c.buildInfo
	if read == nil {
		read = debug.ReadBuildInfo
	}
	bi, ok := read()
	if !ok {
		return versionInfo{Version: "unknown", GoVersion: "unknown"}
	}
	v := versionInfo{Version: bi.Main.Version, GoVersion: bi.GoVersion}
	if v.Version == "" {
		v.Version = "unknown"
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Revision = s.Value
		case "vcs.time":
			v.Time = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	return v
}

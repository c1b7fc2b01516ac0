package main

import (
	"os"

	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/kvm2"
)

// fileConfig is the config file: the kvm2 entries an embedder would give
// kvm2.Open, one per hypervisor.
type fileConfig struct {
	Entries []kvm2.Config `json:"entries"`
}

const configHelp = `Config file (JSON or YAML; "scripts/teststack ctl-config" prints one for the
project's test stack). Each entry is a kvm2.Config, in camelCase:
  entries:
    - entry: lab1                  # provider entry name (part of VM and volume names)
      owner: tooling               # ls, gc and delete see only this owner's proxies
      address: 192.0.2.10:22       # the hypervisor's sshd
      user: root
      keyFile: /home/me/.ssh/id_ed25519
      knownHostsFile: /home/me/.ssh/known_hosts
      pool: default
      images:
        debian-12:
          url: https://mirror.example/debian-12.qcow2
          sha256: <64 hex digits>
`

// loadConfig reads and checks the config file. Unknown fields are errors
// (a typo must not silently drop a setting); the entries themselves are
// validated by kvm2.Open.
func loadConfig(path string) (*fileConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, usagef("config: %v", err)
	}
	var cfg fileConfig
	if err := yaml.UnmarshalStrict(data, &cfg); err != nil {
		return nil, usagef("%s: %v", path, err)
	}
	if len(cfg.Entries) == 0 {
		return nil, usagef("%s: no entries (want at least one under \"entries\")", path)
	}
	seen := map[string]bool{}
	for i, e := range cfg.Entries {
		if err := naming.ValidateName("entry", e.Entry); err != nil {
			return nil, usagef("%s: entries[%d]: %v", path, i, err)
		}
		if seen[e.Entry] {
			return nil, usagef("%s: entries[%d]: entry %q appears twice", path, i, e.Entry)
		}
		seen[e.Entry] = true
	}
	return &cfg, nil
}

package kvm2

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/kdomanski/iso9660"
	"sigs.k8s.io/yaml"
)

// readSeed opens a seed ISO and returns its label and files.
func readSeed(t testing.TB, iso []byte) (string, map[string]string) {
	t.Helper()
	img, err := iso9660.OpenImage(bytes.NewReader(iso))
	if err != nil {
		t.Fatalf("open ISO: %v", err)
	}
	label, err := img.Label()
	if err != nil {
		t.Fatalf("label: %v", err)
	}
	root, err := img.RootDir()
	if err != nil {
		t.Fatal(err)
	}
	kids, err := root.GetChildren()
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{}
	for _, k := range kids {
		b, err := io.ReadAll(k.Reader())
		if err != nil {
			t.Fatal(err)
		}
		files[k.Name()] = string(b)
	}
	return label, files
}

func TestBuildSeed(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		in   seedData
	}{
		{"plain", seedData{InstanceID: "uid-1", Hostname: "proxy-a", UserData: "#cloud-config\npackages: [squid]\n"}},
		{"empty user-data", seedData{InstanceID: "uid-2", Hostname: "p"}},
		{"metacharacters", seedData{InstanceID: `a: b # "c" 'd' <e> & ü ✓`, Hostname: "proxy-b", UserData: "#!/bin/sh\necho '<&>' \"ü\"\n"}},
		{"yaml lookalikes", seedData{InstanceID: "- [x, y]", Hostname: "x", UserData: "---\n..."}},
		{"max user-data", seedData{InstanceID: "u", Hostname: "h", UserData: strings.Repeat("x", naming.MaxUserDataBytes)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			iso, err := buildSeed(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			label, files := readSeed(t, iso)
			if label != "cidata" {
				t.Errorf("label = %q, want cidata", label)
			}
			if got := files["user-data"]; got != tt.in.UserData {
				t.Errorf("user-data = %q, want %q", got, tt.in.UserData)
			}
			var md map[string]string
			if err := yaml.Unmarshal([]byte(files["meta-data"]), &md); err != nil {
				t.Fatalf("meta-data %q: %v", files["meta-data"], err)
			}
			if md["instance-id"] != tt.in.InstanceID || md["local-hostname"] != tt.in.Hostname {
				t.Errorf("meta-data = %v, want %q / %q", md, tt.in.InstanceID, tt.in.Hostname)
			}
			if len(files) != 2 {
				t.Errorf("files = %v, want exactly user-data and meta-data", files)
			}
		})
	}
}

func TestBuildSeedRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		in   seedData
	}{
		{"oversized user-data", seedData{InstanceID: "u", Hostname: "h", UserData: strings.Repeat("x", naming.MaxUserDataBytes+1)}},
		{"no instance id", seedData{Hostname: "h"}},
		{"no hostname", seedData{InstanceID: "u"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := buildSeed(tt.in); errs.Code(err) != errs.Permanent {
				t.Errorf("err = %v, want Permanent", err)
			}
		})
	}
}

// TestBuildSeedSize: the largest seed (64 KiB of user-data) is 44 KiB of
// ISO 9660 metadata plus its files rounded to 2 KiB sectors, and the same
// input (with its creation time) gives the same bytes.
func TestBuildSeedSize(t *testing.T) {
	t.Parallel()
	in := seedData{InstanceID: "uid-1", Hostname: "proxy-a", UserData: strings.Repeat("x", naming.MaxUserDataBytes),
		Created: time.Date(2026, 12, 2, 3, 4, 5, 0, time.UTC)}
	iso, err := buildSeed(in)
	if err != nil {
		t.Fatal(err)
	}
	if want := 22*2048 + naming.MaxUserDataBytes + 2048; len(iso) != want {
		t.Errorf("seed is %d bytes, want %d", len(iso), want)
	}
	again, err := buildSeed(in)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(iso, again) {
		t.Error("the same seed input gave different bytes")
	}
}

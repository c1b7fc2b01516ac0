//go:build integration && e2e

package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// TestStackConfigAsPrinted: the README's newcomer path, exactly as written
// there — `scripts/teststack ctl-config > ctl.yaml` with no flags, then the
// CLI on that file — works against the real stack: check reports the one
// entry reachable, and ls and images ls answer (nothing of this owner, no
// image configured). TestE2ECLI covers the flags that add a network and an
// image; this one keeps the flagless output a config the CLI accepts.
func TestStackConfigAsPrinted(t *testing.T) {
	teststack.Require(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	script, err := filepath.Abs(filepath.Join("..", "..", "scripts", "teststack"))
	if err != nil {
		t.Fatal(err)
	}
	gen := exec.CommandContext(ctx, script, "ctl-config")
	gen.Stderr = os.Stderr
	cfgText, err := gen.Output()
	if err != nil {
		t.Fatalf("%s ctl-config: %v", script, err)
	}
	cfgPath := filepath.Join(t.TempDir(), "ctl.yaml")
	if err := os.WriteFile(cfgPath, cfgText, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("config:\n%s", cfgText)
	cli := &ctlCLI{t: t, ctx: ctx, bin: buildBinary(t), config: cfgPath}

	c := ctlJSON[checkJSON](t, cli.want(exitOK, "-o", "json", "check"))
	if len(c.Entries) != 1 || c.Entries[0].Entry != "teststack" || !c.Entries[0].Reachable {
		t.Fatalf("check: %+v", c)
	}
	if out := cli.want(exitOK, "check"); !strings.Contains(out, "teststack") {
		t.Errorf("check table lacks the entry:\n%s", out)
	}
	if ls := ctlJSON[lsJSON](t, cli.want(exitOK, "-o", "json", "ls")); len(ls.Instances) != 0 {
		t.Errorf("ls: %+v, want no instance of owner egressproxyctl", ls)
	}
	if im := ctlJSON[imagesJSON](t, cli.want(exitOK, "-o", "json", "images", "ls")); len(im.Images) != 0 {
		t.Errorf("images ls: %+v, want none (the flagless config has no image)", im)
	}
}

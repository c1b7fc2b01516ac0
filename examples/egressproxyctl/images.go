package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/naming"
)

type imageRow struct {
	Entry string `json:"entry"`
	egressproxy.ImageInfo
	Error string `json:"error,omitempty"`
}

func cmdImages(ctx context.Context, c *cli, args []string) error {
	fs := c.newFlags("images", "images ls | images verify KEY | images evict KEY")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) == 0 {
		return usagef("images: want a subcommand: ls, verify KEY or evict KEY")
	}
	sub, pos := pos[0], pos[1:]
	var key string
	switch sub {
	case "ls":
		if len(pos) != 0 {
			return usagef("images ls: no arguments expected, got %q", pos)
		}
	case "verify", "evict":
		if len(pos) != 1 {
			return usagef("images %s: want one image KEY, got %q", sub, pos)
		}
		key = pos[0]
		if err := naming.ValidateKey("KEY", key); err != nil {
			return usagef("images %s: %v", sub, err)
		}
	default:
		return usagef("images: unknown subcommand %q (want ls, verify or evict)", sub)
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()

	perEntry := make([][]imageRow, len(c.entries))
	errs := c.forEach(ctx, func(ctx context.Context, e *entry) error {
		i := indexOf(c.entries, e)
		fail := func(err error) error {
			perEntry[i] = []imageRow{{Entry: e.name(), ImageInfo: egressproxy.ImageInfo{Key: key}, Error: err.Error()}}
			return err
		}
		switch sub {
		case "ls":
			infos, err := e.client.ListImages(ctx)
			if err != nil {
				return fail(entryErr(e, err))
			}
			for _, info := range infos {
				perEntry[i] = append(perEntry[i], imageRow{Entry: e.name(), ImageInfo: info})
			}
		case "verify":
			_, stop := c.progress(fmt.Sprintf("reading image %s back from %s", key, e.name()))
			info, err := e.client.VerifyImage(ctx, key)
			stop()
			if err != nil {
				return fail(entryErr(e, err))
			}
			perEntry[i] = []imageRow{{Entry: e.name(), ImageInfo: info}}
		case "evict":
			if err := e.client.EvictImage(ctx, key); err != nil {
				return fail(entryErr(e, err))
			}
			perEntry[i] = []imageRow{{Entry: e.name(), ImageInfo: egressproxy.ImageInfo{Key: key}}}
		}
		return nil
	})
	var rows []imageRow
	for _, r := range perEntry {
		rows = append(rows, r...)
	}
	if c.g.json() {
		if rows == nil {
			rows = []imageRow{}
		}
		if err := c.printJSON(map[string]any{"images": rows}); err != nil {
			return err
		}
		return worst(errs)
	}
	var table [][]string
	for _, r := range rows {
		if r.Error != "" {
			msg := r.Error
			if errors.Is(errs[indexOfName(c.entries, r.Entry)], egressproxy.ErrNotSupported) {
				msg = "image management not supported by this entry's provider"
			}
			table = append(table, []string{r.Entry, r.Key, "error", "", "", "", msg})
			continue
		}
		switch sub {
		case "ls":
			table = append(table, []string{r.Entry, r.Key, yesNo(r.Present), r.Name, short(r.Digest), size(r.SizeBytes), inUseBy(r.ImageInfo)})
		case "verify":
			table = append(table, []string{r.Entry, r.Key, map[bool]string{true: "verified", false: "NOT verified"}[r.Verified], r.Name, short(r.Digest), size(r.SizeBytes), inUseBy(r.ImageInfo)})
		case "evict":
			table = append(table, []string{r.Entry, r.Key, "evicted", "", "", "", ""})
		}
	}
	c.printTable([]string{"ENTRY", "KEY", map[string]string{"ls": "PRESENT", "verify": "RESULT", "evict": "RESULT"}[sub], "NAME", "DIGEST", "SIZE", "IN USE BY"}, table)
	return worst(errs)
}

func indexOfName(es []*entry, name string) int {
	for i, e := range es {
		if e.name() == name {
			return i
		}
	}
	return 0
}

// inUseBy is the IN USE BY column: the users found, and "(unknown)" when
// the entry cannot tell them all (no instance name has parentheses).
func inUseBy(info egressproxy.ImageInfo) string {
	users := slices.Clone(info.InUseBy)
	if info.InUseUnknown {
		users = append(users, "(unknown)")
	}
	return strings.Join(users, ",")
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// short is the first 12 hex digits of a digest, as people read them.
func short(d string) string {
	if len(d) > 12 {
		return d[:12]
	}
	return d
}

func size(n int64) string {
	switch {
	case n == 0:
		return ""
	case n < 1<<20:
		return strconv.FormatInt(n, 10) + " B"
	case n < 1<<30:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
}

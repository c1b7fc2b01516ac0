package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/naming"
)

type imageRow struct {
	Entry string `json:"entry"`
	egressproxy.ImageInfo
}

func newImagesCommand(c *cli) *cobra.Command {
	images := &cobra.Command{
		Use:   "images",
		Short: "Base images of each entry: list, verify, evict",
		Long: `Images manages the verified base images stored on each entry's hypervisor
(one per image key of the entry's config), from which proxies are created.`,
	}
	group(images, "a subcommand: ls, verify KEY or evict KEY")
	images.AddCommand(
		&cobra.Command{
			Use:     "ls",
			Aliases: []string{"list"},
			Short:   "Base images of each entry: key, digest, size, users",
			Long: `Images ls lists the image keys of each selected entry: whether a base is stored
for the key, its volume, digest and size, and the proxies using it ("(unknown)"
when the entry cannot tell them all).`,
			Example: `  egressproxyctl images ls
  egressproxyctl images ls --entry lab1 -o json`,
			Args: args(),
			RunE: func(cmd *cobra.Command, _ []string) error { return c.images(cmd.Context(), "ls", "") },
		},
		&cobra.Command{
			Use:   "verify KEY",
			Short: "Read a stored base back and check its digest",
			Long: `Images verify reads the stored base of image KEY back from each selected
entry's hypervisor and checks it against its recorded digest (exit code 4
when it differs, 5 when no base is stored).`,
			Example:           `  egressproxyctl images verify debian-12 --entry lab1`,
			Args:              args("one image KEY"),
			ValidArgsFunction: c.completeImageKeys,
			RunE:              func(cmd *cobra.Command, a []string) error { return c.images(cmd.Context(), "verify", a[0]) },
		},
		&cobra.Command{
			Use:   "evict KEY",
			Short: "Remove a stored base no proxy uses",
			Long: `Images evict removes the stored base of image KEY from each selected entry's
hypervisor. It is refused while a proxy uses the base (exit code 4).`,
			Example:           `  egressproxyctl images evict debian-12 --entry lab1`,
			Args:              args("one image KEY"),
			ValidArgsFunction: c.completeImageKeys,
			RunE:              func(cmd *cobra.Command, a []string) error { return c.images(cmd.Context(), "evict", a[0]) },
		},
	)
	return images
}

func (c *cli) images(ctx context.Context, sub, key string) error {
	if sub != "ls" {
		if err := naming.ValidateKey("KEY", key); err != nil {
			return cmdLinef("%v", err)
		}
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()

	perEntry := make([][]imageRow, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, i int, e *entry) error {
		infos, err := c.imageCall(ctx, e, sub, key)
		if err != nil {
			return entryErr(e, err)
		}
		for _, info := range infos {
			perEntry[i] = append(perEntry[i], imageRow{Entry: e.name(), ImageInfo: info})
		}
		return nil
	})
	rows := []imageRow{}
	for _, r := range perEntry {
		rows = append(rows, r...)
	}
	status := map[string]string{"ls": "PRESENT", "verify": "RESULT", "evict": "RESULT"}[sub]
	l := listing{doc: map[string]any{"images": rows}, header: []string{"ENTRY", "KEY", status, "NAME", "DIGEST", "SIZE", "IN USE BY"}}
	for _, r := range rows {
		// A failed entry has no row: its error goes to stderr, once.
		switch sub {
		case "ls":
			l.rows = append(l.rows, []string{r.Entry, r.Key, yesNo(r.Present), r.Name, short(r.Digest), size(r.SizeBytes), inUseBy(r.ImageInfo)})
		case "verify":
			l.rows = append(l.rows, []string{r.Entry, r.Key, map[bool]string{true: "verified", false: "NOT verified"}[r.Verified], r.Name, short(r.Digest), size(r.SizeBytes), inUseBy(r.ImageInfo)})
		case "evict":
			l.rows = append(l.rows, []string{r.Entry, r.Key, "evicted", "", "", "", ""})
		}
		l.names = append(l.names, r.Entry+"/"+r.Key)
	}
	if err := c.print(l); err != nil {
		return err
	}
	return worst(problems)
}

// imageCall runs one image subcommand on one entry and returns the rows it
// has to show.
func (c *cli) imageCall(ctx context.Context, e *entry, sub, key string) ([]egressproxy.ImageInfo, error) {
	switch sub {
	case "ls":
		return e.client.ListImages(ctx)
	case "verify":
		_, stop := c.progress(fmt.Sprintf("reading image %s back from %s", key, e.name()))
		info, err := e.client.VerifyImage(ctx, key)
		stop()
		if err != nil {
			return nil, err
		}
		return []egressproxy.ImageInfo{info}, nil
	}
	if err := e.client.EvictImage(ctx, key); err != nil {
		return nil, err
	}
	return []egressproxy.ImageInfo{{Key: key}}, nil
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

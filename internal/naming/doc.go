// Package naming holds the rules for the names the library accepts: an
// instance or entry name is a lowercase DNS label without "--" (so it is a
// safe component of volume and domain names), an image key or machine type
// name the same with '.', a UID valid UTF-8 without control characters; and
// the limits of a Spec. Each rule is written once here and used by the
// client, the backends and their configuration.
package naming

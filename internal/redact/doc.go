// Package redact removes the credentials an image URL may carry (a user
// name and password, a bearer token as user name, a signed query: S3's
// X-Amz-Signature, GCS's X-Goog-Signature, Azure's sig, a plain token=)
// from whatever is printed about it: errors, log lines, spans, String and
// marshalled values. Everything the image cache prints about a URL goes
// through URL, or, for text that may embed one, Text and Err.
package redact

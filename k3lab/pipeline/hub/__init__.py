"""The Hugging Face Hub client every stage uses (the Hub source, publishing, checking a set on the
Hub, the card): ``env`` (where the Hub is, the token, the retry budget), ``transport`` (huggingface_hub's
HTTP, bounded in bytes and time; ranged reads; resumable downloads), ``bounds`` (every transfer
bounded both ways: decoded bytes, API answers' shape, the minimum rate on answers and uploads), ``retry`` (the one backoff
loop: outages ridden out within a time budget, what is transient), ``files`` (a file as a pinned
commit lists it, and its checked download), ``ranges`` (the bounded, self-proving cache of fetched
byte ranges, keyed by the file's identity at the Hub) and ``range_files`` (its entries on disk)."""

"""The service around the conversations: the HTTP/WebSocket server, who may connect (auth), how many (limits,
capacity), who gets the cores (scheduler), and the call records (records, recordsdb).
"""
